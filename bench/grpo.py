"""GRPO side by side: ftkit's recipes/grpo_llm.py against TRL's GRPOTrainer on the embedded tiny Llama with
LoRA, the embedded arithmetic prompts and two rewards, exact answer and format; the same completions a step,
G, completion length, learning rate and steps, HF generate on both. Round-robin repeats, each run a fresh
process. Writes its table between the GRPO markers of bench/RESULTS.md and every run's figures, per step, to
bench/raw_grpo.json (also run by `make bench`).

    python bench/grpo.py [--repeats 2]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from common import ROOT, write_results
from harness import run_from_command_line, run_process, table

from toolkit.train.metrics import read_metrics

BENCH = Path(__file__).resolve().parent
PY = sys.executable
BEGIN, END = "<!-- make bench grpo: begin -->", "<!-- make bench grpo: end -->"
MODEL = ROOT / "toolkit" / "assets" / "tiny-llama"
PROMPTS = ROOT / "toolkit" / "assets" / "demo" / "train.jsonl"
STEPS = 20
WARMUP = 2  # steps left out of the rates and shares: the first ones warm the allocator and generate's caches
GROUP = 8  # G: completions sampled per prompt
COMPLETIONS = 64  # a step's completions: 8 prompts x G, one generation round a step
MAX_NEW_TOKENS = 16
LEARNING_RATE = 2e-4
# The format reward's pattern: the completion, stripped, ends in a digit. The tiny model never gives the exact
# answer; about half its completions end in a digit, so the rewards vary within almost every group.
FORMAT_PATTERN = r".*\d"
FTKIT, TRL = "ftkit", "TRL GRPOTrainer"


def commands(work: Path) -> dict[str, list[str]]:
    out = work / "out"
    ftkit = [PY, str(ROOT / "recipes" / "grpo_llm.py"), "--config", str(BENCH / "ftkit-grpo.yaml"),
             f"model.path={MODEL}", f"data.train={PROMPTS}", f"output_dir={out / 'ftkit'}",
             f"train.max_steps={STEPS}", f"train.global_batch_size={COMPLETIONS}",
             f"train.micro_batch_size={COMPLETIONS}", f"train.learning_rate={LEARNING_RATE}",
             f"grpo.num_generations={GROUP}", f"grpo.max_new_tokens={MAX_NEW_TOKENS}",
             f"grpo.format_pattern={FORMAT_PATTERN}"]  # fmt: skip
    trl = [PY, str(BENCH / "trl_grpo.py"), str(MODEL), str(PROMPTS), str(out / "trl"), str(STEPS),
           str(COMPLETIONS), str(GROUP), str(MAX_NEW_TOKENS), str(LEARNING_RATE), FORMAT_PATTERN]  # fmt: skip
    return {FTKIT: ftkit, TRL: trl}


def step_record(name: str, work: Path) -> dict:
    """Per step of the run just made: end time, generation seconds, loss, mean reward and the format
    reward's, gradient norm before clipping, share of groups without reward spread, mean completion length;
    and the start of step 1."""
    if name == FTKIT:
        lines = [x for x in read_metrics(work / "out" / "ftkit" / "metrics.jsonl") if "step_time_s" in x]
        return {
            "end": [x["time"] for x in lines],
            "generation_s": [x["generation_s"] for x in lines],
            "loss": [x["loss"] for x in lines],
            "reward": [x["reward"] for x in lines],
            "reward_format": [x["reward_format"] for x in lines],
            "grad_norm": [x["grad_norm"] for x in lines],
            "zero_std_frac": [x["zero_std_frac"] for x in lines],
            "completion_len": [x["completion_len"] for x in lines],
            "begin": lines[0]["time"] - lines[0]["step_time_s"],
        }
    record = json.loads((work / "stats.json").read_text())
    return {**record, "end": record.pop("step_end"), "begin": record.pop("first_step_begin")}


def figures(steps: dict, run) -> dict:
    """Rates and shares over steps WARMUP+1.. (from the end of step WARMUP to the last end); `run` =
    (launch time, wall seconds, peak RSS MB)."""
    launched, wall, rss_mb = run
    ends, generation = steps["end"], steps["generation_s"][WARMUP:]
    span = ends[-1] - ends[WARMUP - 1]
    intervals = [b - a for a, b in zip(ends[WARMUP - 1 :], ends[WARMUP:])]
    measured = len(ends) - WARMUP
    return {
        "steps_per_s": measured / span,
        "completions_per_s": measured * COMPLETIONS / span,
        "step_s": statistics.median(intervals),
        "fastest_s": min(intervals),
        "generation_s": statistics.median(generation),
        "rest_s": statistics.median(i - g for i, g in zip(intervals, generation, strict=True)),
        "generation_share": sum(generation) / span,
        "completion_len": statistics.mean(steps["completion_len"]),
        "loss": statistics.mean(steps["loss"]),
        "reward": statistics.mean(steps["reward"]),
        "reward_format": statistics.mean(steps["reward_format"]),
        "grad_norm": statistics.mean(steps["grad_norm"]),
        "zero_std_frac": statistics.mean(steps["zero_std_frac"]),
        "rss_mb": rss_mb,
        "setup_s": steps["begin"] - launched,
        "wall_s": wall,
        "steps": steps,
    }


def run_once(name: str, cmd: list[str], work: Path) -> dict:

    run = run_process(name, cmd, work)
    return figures(step_record(name, work), run)


COLUMNS = [
    ("steps_per_s", "steps/s", "{:.3f}"),
    ("completions_per_s", "completions/s", "{:.1f}"),
    ("step_s", "step time median (s)", "{:.2f}"),
    ("fastest_s", "fastest step (s)", "{:.2f}"),
    ("generation_share", "generation share", "{:.0%}"),
    ("generation_s", "generation a step, median (s)", "{:.2f}"),
    ("rest_s", "rest of the step, median (s)", "{:.2f}"),
    ("completion_len", "completion tokens, mean", "{:.2f}"),
    ("loss", "loss, mean of all steps", "{:+.1e}"),
    ("reward", "reward, mean of all steps", "{:.3f}"),
    ("reward_format", "of which format", "{:.3f}"),
    ("zero_std_frac", "groups without reward spread", "{:.1%}"),
    ("grad_norm", "grad norm, mean of all steps", "{:.3f}"),
    ("rss_mb", "peak RSS (MB)", "{:.0f}"),
    ("setup_s", "launch → start of step 1 (s)", "{:.1f}"),
    ("wall_s", "whole run (s)", "{:.1f}"),
]


def verdicts(results: dict[str, list[dict]]) -> str:
    """The steps/s target on medians, the same ratio on the fastest steps, and both generation shares."""

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    ours, theirs = median(FTKIT, "steps_per_s"), median(TRL, "steps_per_s")
    met = ours / theirs >= 1.2
    fastest = median(TRL, "fastest_s") / median(FTKIT, "fastest_s")
    shares = ", ".join(f"{name} {median(name, 'generation_share'):.0%}" for name in results)
    return "\n".join(
        [
            f"- ftkit steps/s >= 1.2x TRL GRPOTrainer's: **{'met' if met else 'not met'}** — median "
            f"{ours:.3f} against {theirs:.3f}, ratio {ours / theirs:.3f}",
            f"- the same on the fastest steps (the least disturbed by other work on the machine): TRL's "
            f"fastest step over ftkit's, medians over runs, {fastest:.3f}",
            f"- generation share of the step time (steps {WARMUP + 1}-{STEPS}): {shares}",
            "- the two sample differently (ftkit: seeded Gumbel-max, noise counted from each completion's "
            "seed; TRL: `generate`'s torch.multinomial), so their rewards, losses and gradient norms "
            "agree only as statistics over steps and runs, never step by step",
        ]
    )


def run_section(repeats: int, machine) -> str:
    """Both contenders `repeats` times round-robin; returns the markdown block it also writes."""

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cmds = commands(work)
        results: dict[str, list[dict]] = {name: [] for name in cmds}
        for repeat in range(repeats):  # round-robin, so drift in machine speed hits every contender
            for name, cmd in cmds.items():
                results[name].append(run_once(name, cmd, work))
                shown = {k: v for k, v in results[name][-1].items() if k != "steps"}
                print(f"[grpo {repeat + 1}/{repeats}] {name}: {shown}", flush=True)
    head = (
        f"Machine: {machine()}. {repeats} runs of each contender; rates and shares over steps "
        f"{WARMUP + 1}-{STEPS} of each run; cells are min / median / max over the runs."
    )
    block = "\n\n".join([head, table(results, COLUMNS), verdicts(results)])
    write_results(BENCH / "RESULTS.md", block, (BEGIN, END))
    (BENCH / "raw_grpo.json").write_text(json.dumps({"machine": machine(), "runs": results}, indent=1))
    return block


if __name__ == "__main__":
    run_from_command_line(__doc__, run_section, repeats=2)
