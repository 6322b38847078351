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
    """Each tool on the whole model, and on a LoRA adapter over it (ftkit's usual `final/`; lm-eval's
    `peft=` model argument): ftkit's name says which, lm-eval's the same with its own."""
    model, adapter = str(work / "model"), str(work / "adapter")
    ftkit = [PY, "-m", "toolkit.commands.cli", "eval", "--tasks", TASKS, "--base", "none"]
    ftkit += ["--batch-size", str(BATCH), "--json"]
    lm_eval = [PY, "-m", "lm_eval", "run", "--model", "hf", "--tasks", TASKS, "--include_path"]
    lm_eval += [str(work / "tasks"), "--apply_chat_template", "--device", "cpu", "--batch_size", str(BATCH)]
    lm_eval += ["--output_path", str(work / "lm_eval")]
    return {
        "ftkit eval, whole model": [*ftkit, "--model", model],
        "lm-eval run --model hf, whole model": [*lm_eval, "--model_args", f"pretrained={model}"],
        "ftkit eval, adapter": [*ftkit, "--model", adapter],
        "lm-eval run --model hf, adapter": [*lm_eval, "--model_args", f"pretrained={model},peft={adapter}"],
    }


def write_adapter(work: Path) -> None:
    """A LoRA adapter over the model (random B, so it changes the scores) with the tokenizer beside it, as
    ftkit's final/ holds one."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(work / "model")
    lora = LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(base, lora).save_pretrained(work / "adapter")
    AutoTokenizer.from_pretrained(work / "model").save_pretrained(work / "adapter")


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
    if name.startswith("ftkit eval"):
        scores = {row["task"]: row["tuned"] for row in json.loads((work / "stdout").read_text())["rows"]}
    else:
        (found,) = (work / "lm_eval").rglob("results_*.json")
        results = json.loads(found.read_text())["results"]
        scores = {
            task: results[task].get("exact_match,none", results[task].get("acc,none")) for task in results
        }
    return {"wall_s": wall, "rss_mb": usage.ru_maxrss / 1024, **scores}


def verdict(results: dict[str, list[dict]]) -> str:
    lines = []
    for what in ("whole model", "adapter"):
        ours, theirs = results[f"ftkit eval, {what}"], results[f"lm-eval run --model hf, {what}"]
        ratio = statistics.median(r["wall_s"] for r in ours) / statistics.median(r["wall_s"] for r in theirs)
        keys = ("ftkit_sums", "ftkit_sums_choice")
        same = all(
            {k: a[k] for k in keys} == {k: b[k] for k in keys} for a, b in zip(ours, theirs, strict=True)
        )
        lines.append(
            f"- {what}: ftkit eval's whole command at most 5% over lm-eval's own HF backend: "
            f"**{'met' if ratio <= TARGET else 'not met'}** (median ratio {ratio:.3f}); the same scores from "
            f"both on every run: **{'yes' if same else 'no'}**"
        )
    return "\n".join(lines)


def run_section(repeats: int, machine) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_model_dir(work / "model")
        write_adapter(work)
        (work / "tasks").mkdir()
        for name, spec in local_tasks().items():
            (work / "tasks" / f"{name}.yaml").write_text(yaml.safe_dump(spec))
        cmds = commands(work)
        results = round_robin("eval", cmds, repeats, lambda name, cmd: run_once(name, cmd, work))
    block = "\n\n".join(
        [
            f"Machine: {machine()}. {repeats} runs of each command, one model (~20M parameters) and a LoRA "
            f"adapter (r 8, every linear layer) over it, both local tasks whole, batch {BATCH}, chat "
            "template applied; cells are min / median / max.",
            table(results, COLUMNS),
            verdict(results),
        ]
    )
    write_results(BENCH / "RESULTS.md", block, (BEGIN, END))
    (BENCH / "raw_eval.json").write_text(json.dumps({"machine": machine(), "runs": results}, indent=1))
    return block


if __name__ == "__main__":
    run_from_command_line(__doc__, run_section, 3)
