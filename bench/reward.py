"""Reward models side by side: ftkit's recipes/reward_llm.py against TRL's RewardTrainer on the SFT
benchmark's model, LoRA with the scalar head trained whole, on the same preference pairs, global batch,
sequence length, learning rate and steps; round-robin repeats. Writes its table between the reward-model
markers of bench/RESULTS.md and every run's figures to bench/raw_reward.json (also run by `make bench`).

    python bench/reward.py [--repeats 3]
"""

import json
import statistics
import sys
import tempfile
from pathlib import Path

from common import (
    BATCH,
    LEARNING_RATE,
    ROOT,
    SEQ_LEN,
    STEPS,
    build_model_dir,
    step_figures,
    write_pairs,
    write_results,
)
from dpo import COLUMNS, step_record
from harness import round_robin, run_from_command_line, run_process, table

BENCH = Path(__file__).resolve().parent
PY = sys.executable
BEGIN, END = "<!-- make bench reward: begin -->", "<!-- make bench reward: end -->"
FTKIT, TRL = "ftkit", "TRL RewardTrainer"


def commands(work: Path) -> dict[str, list[str]]:
    model, pairs, out = str(work / "model"), str(work / "pairs.jsonl"), work / "out"
    return {
        FTKIT: [
            PY,
            str(ROOT / "recipes" / "reward_llm.py"),
            "--config",
            str(BENCH / "ftkit-rm.yaml"),
            f"model.path={model}",
            f"data.train={pairs}",
            f"train.max_steps={STEPS}",
            f"train.global_batch_size={BATCH}",
            f"train.micro_batch_size={BATCH}",
            f"train.learning_rate={LEARNING_RATE}",
            f"data.max_length={SEQ_LEN}",
            f"output_dir={out / 'ftkit'}",
        ],
        TRL: [PY, str(BENCH / "trl_reward.py"), model, pairs, str(out / "trl")],
    }


def run_once(name: str, cmd: list[str], work: Path) -> dict:
    run = run_process(name, cmd, work)
    metrics_file = work / "out" / "ftkit" / "metrics.jsonl" if name == FTKIT else None
    return step_figures("pairs_per_s", *step_record(metrics_file, work), run)


def verdicts(results: dict[str, list[dict]]) -> str:
    """The ratios of the medians: pairs/s and peak memory, ftkit over TRL."""
    ours, theirs = results[FTKIT], results[TRL]
    lines = []
    for key, what in (("pairs_per_s", "pairs/s"), ("rss_mb", "peak RSS")):
        mine, other = (statistics.median(r[key] for r in runs) for runs in (ours, theirs))
        lines.append(f"- {what}: ftkit {mine:.3g} against TRL {other:.3g}, ratio {mine / other:.3f}")
    return "\n".join(lines)


def run_section(repeats: int, machine) -> str:
    """Both contenders `repeats` times round-robin; returns the markdown block it also writes."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_model_dir(work / "model")
        write_pairs(work / "pairs.jsonl")
        results = round_robin("reward", commands(work), repeats, lambda n, c: run_once(n, c, work))
    head = f"Machine: {machine()}. {repeats} runs of each contender; cells are min / median / max."
    block = "\n\n".join([head, table(results, COLUMNS), verdicts(results)])
    write_results(BENCH / "RESULTS.md", block, (BEGIN, END))
    (BENCH / "raw_reward.json").write_text(json.dumps({"machine": machine(), "runs": results}, indent=1))
    return block


if __name__ == "__main__":
    run_from_command_line(__doc__, run_section, repeats=3)
