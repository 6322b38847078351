"""DPO side by side: ftkit's recipes/dpo_llm.py against TRL's DPOTrainer on the SFT benchmark's model,
LoRA, on the same preference pairs, global batch, sequence length, learning rate and steps; round-robin
repeats. Writes its table between the DPO markers of bench/RESULTS.md and every run's figures to
bench/raw_dpo.json (also run by `make bench`, after the SFT table).

    python bench/dpo.py [--repeats 3]
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
from harness import run_from_command_line, run_process, table

from toolkit.train.metrics import read_metrics

BENCH = Path(__file__).resolve().parent
PY = sys.executable
BEGIN, END = "<!-- make bench dpo: begin -->", "<!-- make bench dpo: end -->"


def commands(work: Path) -> dict[str, list[str]]:
    model, pairs, out = str(work / "model"), str(work / "pairs.jsonl"), work / "out"
    trl = [PY, str(BENCH / "trl_dpo.py")]
    ftkit = [
        PY,
        str(ROOT / "recipes" / "dpo_llm.py"),
        "--config",
        str(BENCH / "ftkit-dpo.yaml"),
        f"model.path={model}",
        f"data.train={pairs}",
        f"train.max_steps={STEPS}",
        f"train.global_batch_size={BATCH}",
        f"train.micro_batch_size={BATCH}",
        f"train.learning_rate={LEARNING_RATE}",
        f"data.max_length={SEQ_LEN}",
    ]
    return {
        "ftkit": [*ftkit, f"output_dir={out / FTKIT_OUT['ftkit']}"],
        GROUPED: [*ftkit, "data.group_by_length=true", f"output_dir={out / FTKIT_OUT[GROUPED]}"],
        "TRL DPOTrainer": [*trl, "chat", model, pairs, str(out / "trl")],
        "TRL DPOTrainer, ftkit's token rows": [*trl, "text", model, pairs, str(out / "trl-text")],
    }  # fmt: skip


GROUPED = "ftkit group_by_length"
FTKIT_OUT = {"ftkit": "ftkit", GROUPED: "ftkit-grouped"}


def step_record(metrics_file: Path | None, work: Path) -> tuple[list[float], list[int], float, float]:
    """(step end times, pairs per step, loss of the last step, start of step 1) of the run just made: an
    ftkit run's from its `metrics_file`, a TRL script's (None) from the stats it wrote."""
    if metrics_file is not None:
        lines = [x for x in read_metrics(metrics_file) if "pairs_per_s" in x]
        pairs = [round(x["pairs_per_s"] * x["step_time_s"]) for x in lines]
        return (
            [x["time"] for x in lines],
            pairs,
            lines[-1]["loss"],
            lines[0]["time"] - lines[0]["step_time_s"],
        )
    record = json.loads((work / "stats.json").read_text())
    return record["step_end"], record["tokens"], record["loss"], record["first_step_begin"]


def run_once(name: str, cmd: list[str], work: Path) -> dict:

    run = run_process(name, cmd, work)
    metrics_file = work / "out" / FTKIT_OUT[name] / "metrics.jsonl" if name in FTKIT_OUT else None
    return step_figures("pairs_per_s", *step_record(metrics_file, work), run)


COLUMNS = [
    ("pairs_per_s", "pairs/s", "{:.2f}"),
    ("step_s", "step time median (s)", "{:.2f}"),
    ("setup_s", "launch → start of step 1 (s)", "{:.1f}"),
    ("first_step_s", "launch → end of step 1 (s)", "{:.1f}"),
    ("rss_mb", "peak RSS (MB)", "{:.0f}"),
    ("loss", "final loss", "{:.4f}"),
    ("wall_s", "whole run (s)", "{:.1f}"),
]


def verdicts(results: dict[str, list[dict]]) -> str:
    """The pairs/s target on medians, and how far the final losses of equal token rows lie apart."""
    lines = []
    theirs = statistics.median(r["pairs_per_s"] for r in results["TRL DPOTrainer"])
    for name in ("ftkit", GROUPED):
        ours = statistics.median(r["pairs_per_s"] for r in results[name])
        met = ours / theirs >= 1.2
        lines.append(
            f"- {name} pairs/s >= 1.2x TRL DPOTrainer's default: **{'met' if met else 'not met'}** — "
            f"median {ours:.3g} against {theirs:.3g}, ratio {ours / theirs:.3f}"
        )
    same = results["TRL DPOTrainer, ftkit's token rows"][0]["loss"]
    gap = abs(results["ftkit"][0]["loss"] - same)
    lines.append(
        f"- final loss on equal batches (ftkit against TRL given ftkit's token rows): "
        f"{results['ftkit'][0]['loss']:.5f} against {same:.5f}, difference {gap:.1e}"
    )
    return "\n".join(lines)


def run_section(repeats: int, machine) -> str:
    """Every contender `repeats` times round-robin; returns the markdown block it also writes."""

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_model_dir(work / "model")
        write_pairs(work / "pairs.jsonl")
        cmds = commands(work)
        results: dict[str, list[dict]] = {name: [] for name in cmds}
        for repeat in range(repeats):  # round-robin, so drift in machine speed hits every contender
            for name, cmd in cmds.items():
                results[name].append(run_once(name, cmd, work))
                print(f"[dpo {repeat + 1}/{repeats}] {name}: {results[name][-1]}", flush=True)
    head = f"Machine: {machine()}. {repeats} runs of each contender; cells are min / median / max."
    block = "\n\n".join([head, table(results, COLUMNS), verdicts(results)])
    write_results(BENCH / "RESULTS.md", block, (BEGIN, END))
    (BENCH / "raw_dpo.json").write_text(json.dumps({"machine": machine(), "runs": results}, indent=1))
    return block


if __name__ == "__main__":
    run_from_command_line(__doc__, run_section, repeats=3)
