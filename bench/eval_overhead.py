"""`ftkit eval` against lm-eval's own HF backend (`lm-eval run --model hf`) on the same model files, tasks,
batch size and chat template: each whole command's wall time and peak memory, round-robin repeats, and the
scores each gives, which must agree. The model is the SFT section's (~20M parameters, so scoring shows
beside start-up); the tasks are ftkit's two local ones, every example. Writes its table between the eval
markers of bench/RESULTS.md and every run's figures to bench/raw_eval.json (also run by `make bench`).

    python bench/eval_overhead.py [--repeats 3]
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import ROOT, build_model_dir, write_results
from harness import BENCH, round_robin, run_from_command_line, table

from toolkit.evaluation.tasks import local_tasks

PY = sys.executable
BEGIN, END = "<!-- make bench eval: begin -->", "<!-- make bench eval: end -->"
TASKS = "ftkit_sums,ftkit_sums_choice"
BATCH = 8
COLUMNS = [
    ("wall_s", "whole command (s)", "{:.1f}"),
    ("rss_mb", "peak RSS (MB)", "{:.0f}"),
    ("ftkit_sums", "ftkit_sums exact match", "{:.4f}"),
    ("ftkit_sums_choice", "ftkit_sums_choice acc", "{:.4f}"),
]
TARGET = 1.05  # ftkit's whole command at most 5% slower than lm-eval's


def commands(work: Path) -> dict[str, list[str]]:
    model = str(work / "model")
    ftkit = [PY, "-m", "toolkit.commands.cli", "eval", "--model", model, "--tasks", TASKS, "--base", "none"]
    lm_eval = [PY, "-m", "lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={model}"]
    lm_eval += ["--tasks", TASKS, "--include_path", str(work / "tasks"), "--apply_chat_template"]
    lm_eval += ["--device", "cpu", "--output_path", str(work / "lm_eval")]
    return {
        "ftkit eval": [*ftkit, "--batch-size", str(BATCH), "--json"],
        "lm-eval run --model hf": [*lm_eval, "--batch_size", str(BATCH)],
    }


def run_once(name: str, cmd: list[str], work: Path) -> dict:
    """One command to its end: wall seconds, peak RSS and each task's score (from ftkit's JSON, or the
    results file lm-eval writes)."""
    for old in (work / "lm_eval").rglob("results_*.json"):
        old.unlink()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.time()
    with open(work / "stdout", "wb") as out, open(work / "stderr", "wb") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.time() - start
    if status != 0:
        raise SystemExit(f"{name} failed:\n{(work / 'stderr').read_text()[-3000:]}")
    if name == "ftkit eval":
        scores = {row["task"]: row["tuned"] for row in json.loads((work / "stdout").read_text())["rows"]}
    else:
        (found,) = (work / "lm_eval").rglob("results_*.json")
        results = json.loads(found.read_text())["results"]
        scores = {
            task: results[task].get("exact_match,none", results[task].get("acc,none")) for task in results
        }
    return {"wall_s": wall, "rss_mb": usage.ru_maxrss / 1024, **scores}


def verdict(results: dict[str, list[dict]]) -> str:
    ours = statistics.median(r["wall_s"] for r in results["ftkit eval"])
    theirs = statistics.median(r["wall_s"] for r in results["lm-eval run --model hf"])
    same = all(
        {k: r[k] for k in ("ftkit_sums", "ftkit_sums_choice")}
        == {k: t[k] for k in ("ftkit_sums", "ftkit_sums_choice")}
        for r, t in zip(results["ftkit eval"], results["lm-eval run --model hf"], strict=True)
    )
    met = "met" if ours / theirs <= TARGET else "not met"
    return (
        f"- ftkit eval's whole command at most 5% over lm-eval's own HF backend: **{met}**"
        f" — median {ours:.1f} s against {theirs:.1f} s, ratio {ours / theirs:.3f}\n"
        f"- the same scores from both on every run: **{'yes' if same else 'no'}**"
    )


def run_section(repeats: int, machine) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_model_dir(work / "model")
        (work / "tasks").mkdir()
        for name, spec in local_tasks().items():
            (work / "tasks" / f"{name}.yaml").write_text(yaml.safe_dump(spec))
        cmds = commands(work)
        results = round_robin("eval", cmds, repeats, lambda name, cmd: run_once(name, cmd, work))
    block = "\n\n".join(
        [
            f"Machine: {machine()}. {repeats} runs of each command, one model (~20M parameters), both local "
            f"tasks whole, batch {BATCH}, chat template applied; cells are min / median / max.",
            table(results, COLUMNS),
            verdict(results),
        ]
    )
    write_results(BENCH / "RESULTS.md", block, (BEGIN, END))
    (BENCH / "raw_eval.json").write_text(json.dumps({"machine": machine(), "runs": results}, indent=1))
    return block


if __name__ == "__main__":
    run_from_command_line(__doc__, run_section, 3)
