"""Vision-language models side by side: ftkit's recipes/finetune_llm.py on the vision demo's config against
TRL's SFTTrainer, both LoRA on the language model of the embedded tiny Llava (tower and projector frozen),
on the demo's picture questions, with the same global batch, sequence length, learning rate and steps;
round-robin repeats. Before the runs, each tool is asked once to pack image rows (2 steps) and what it
answers goes into the block. Writes its table between the vision markers of bench/RESULTS.md and every
run's figures to bench/raw_vision.json (also run by `make bench`).

    python bench/vision.py [--repeats 3] [--steps 30]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, SEED, step_figures, write_results
from harness import BENCH, machine, round_robin, run_process, table

from toolkit.config import load_config
from toolkit.train.metrics import read_metrics

PY = sys.executable
BEGIN, END = "<!-- make bench vision: begin -->", "<!-- make bench vision: end -->"
STEPS = 30

# The shipped demo's settings are every contender's: batch, micro-batch, length, learning rate, LoRA.
CONFIG = ROOT / "recipes" / "configs" / "demo-vision.yaml"
DEMO = load_config(CONFIG)
MODEL = ROOT / DEMO.model.path
DATA = ROOT / DEMO.data.train
GLOBAL_BATCH = DEMO.train.global_batch_size
MICRO_BATCH = DEMO.train.micro_batch_size
MAX_LENGTH = DEMO.data.max_length
LEARNING_RATE = DEMO.train.learning_rate
LORA = {"r": DEMO.lora.r, "alpha": DEMO.lora.alpha}


def accumulation() -> int:
    """Micro-batches an optimizer step, in one process."""
    return GLOBAL_BATCH // MICRO_BATCH


def ftkit_command(out: Path, steps: int) -> list[str]:
    """The demo's config with the bench's schedule: constant rate, a metrics line every step, no held-out
    evaluation, and loss on every text token as in TRL's default (the demo trains the answers only)."""
    return [PY, str(ROOT / "recipes" / "finetune_llm.py"), "--config", str(CONFIG),
            f"output_dir={out}", f"train.max_steps={steps}", f"seed={SEED}", "train.lr_scheduler=constant",
            "train.warmup_steps=0", "train.log_every_steps=1", "train.overwrite=true", "data.eval=null",
            "data.eval_fraction=0", "eval.exact_match_samples=0",
            "data.assistant_only_loss=false"]  # fmt: skip


def commands(work: Path, steps: int) -> dict[str, list[str]]:
    trl = [PY, str(BENCH / "trl_vision.py"), "plain", str(work / "out" / "trl"), str(steps)]
    return {"ftkit": ftkit_command(work / "out" / "ftkit", steps), "TRL SFTTrainer": trl}


def run_once(name: str, cmd: list[str], work: Path) -> dict:
    run = run_process(name, cmd, work)
    if name == "ftkit":
        lines = [x for x in read_metrics(work / "out" / "ftkit" / "metrics.jsonl") if "tokens_per_s" in x]
        ends = [x["time"] for x in lines]
        tokens = [round(x["tokens_per_s"] * x["step_time_s"]) for x in lines]
        begin = ends[0] - lines[0]["step_time_s"]  # a step's time includes waiting for its batch
        return step_figures("tokens_per_s", ends, tokens, lines[-1]["loss"], begin, run)
    record = json.loads((work / "stats.json").read_text())
    ends, tokens, loss = record["step_end"], record["tokens"], record["loss"]
    return step_figures("tokens_per_s", ends, tokens, loss, record["first_step_begin"], run)


def packing_answers(work: Path) -> dict[str, str]:
    """What each tool does when asked to pack image rows, trained for 2 steps: "trained", or the last line
    of its error."""
    trl = [PY, str(BENCH / "trl_vision.py")]
    asks = {
        "ftkit data.packing=true": [*ftkit_command(work / "out" / "ftkit-packing", 2), "data.packing=true"],
        "TRL packing=True": [*trl, "packing", str(work / "out" / "trlp"), "2"],
        "TRL padding_free=True": [*trl, "padding-free", str(work / "out" / "trlf"), "2"],
    }
    env = {**os.environ, "BENCH_STATS": str(work / "stats.json"), "PYTHONPATH": str(BENCH)}
    answers = {}
    for name, cmd in asks.items():
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        lines = [x.strip() for x in done.stderr.splitlines() if x.strip()]
        answers[name] = "trained" if done.returncode == 0 else (lines or ["(no message)"])[-1]
        print(f"[vision packing] {name}: {answers[name]}", flush=True)
    return answers


def notes(answers: dict[str, str], steps: int) -> str:
    asked = "; ".join(f"{name}: `` {answer} ``" for name, answer in answers.items())
    packed = [name for name, answer in answers.items() if answer == "trained"]
    verdict = (
        f"{', '.join(packed)} trained on image rows: a packed contender can join the table"
        if packed
        else "neither tool packs image rows, so no packed contender runs"
    )
    return "\n".join(
        [
            f"- Settings of both: {CONFIG.relative_to(ROOT)} (tiny Llava, its train rows), {steps} steps "
            f"of {GLOBAL_BATCH} rows ({accumulation()} micro-batches of {MICRO_BATCH}), max length "
            f"{MAX_LENGTH}, learning rate {LEARNING_RATE:g} constant, LoRA r {LORA['r']} alpha "
            f"{LORA['alpha']} on the language model's linear layers, float32, no gradient checkpointing.",
            "- Packing, asked of each for 2 steps on these rows (the last line of each answer): "
            f"{asked}: {verdict}.",
            "- Final loss: ftkit's is over every text token (data.assistant_only_loss=false, as TRL's "
            "default); TRL's labels also keep each row's image tokens, which ftkit leaves out, so the two "
            "losses average over different tokens.",
        ]
    )


def run_section(repeats: int, machine, steps: int = STEPS) -> str:
    """The packing question, then every contender `repeats` times round-robin; returns the markdown block
    it also writes."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        answers = packing_answers(work)
        cmds = commands(work, steps)
        results = round_robin("vision", cmds, repeats, lambda name, cmd: run_once(name, cmd, work))
    head = f"Machine: {machine()}. {repeats} runs of each contender; cells are min / median / max."
    block = "\n\n".join([head, table(results), notes(answers, steps)])
    write_results(BENCH / "RESULTS.md", block, (BEGIN, END))
    raw = {"machine": machine(), "steps": steps, "packing": answers, "runs": results}
    (BENCH / "raw_vision.json").write_text(json.dumps(raw, indent=1))
    return block


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    print(run_section(args.repeats, machine, args.steps))
