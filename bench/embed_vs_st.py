"""Embeddings side by side: ftkit's recipes/embed_llm.py against sentence-transformers' own trainer
(SentenceTransformerTrainer with MultipleNegativesRankingLoss, bench/st_embed.py) on the embedded tiny Llama
as a bare decoder (toolkit/assets/tiny-llama, no dropout; the tiny BERT's mean-pooled vectors start all but
equal, cosine 0.99999, so its gradients are at Adam's epsilon and neither side repeats its own run), full
fine-tuning, mean pooling, InfoNCE over in-batch and hard negatives at temperature 0.05 (scale 20), the same
triplets (the first rows of the embedding demo's, one hard negative each: one global batch, so every step of
both sides sees the same rows), batch, sequence cap, constant learning rate, clipping and steps; round-robin
repeats. Reports real tokens/s (anchors', positives' and negatives' tokens), peak RSS and the two loss
curves; writes its block between the embedding markers of bench/RESULTS.md and every run's figures to
bench/raw_embed.json (also run by `make bench`).

    nice -n 10 python bench/embed_vs_st.py [--repeats 3]
"""

import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from common import ROOT, step_figures, write_results
from harness import round_robin, run_from_command_line, run_process, table

from toolkit.train.metrics import read_metrics

BENCH = Path(__file__).resolve().parent
PY = sys.executable
BEGIN, END = "<!-- make bench embed: begin -->", "<!-- make bench embed: end -->"
FTKIT, ST = "ftkit", "sentence-transformers"
ROWS, STEPS, MAX_LENGTH, LEARNING_RATE = 16, 20, 64, 5.0e-4
SHOWN_STEPS = (1, 2, 3, 5, 10, 15, 20)
COLUMNS = [
    ("tokens_per_s", "real tokens/s", "{:.0f}"),
    ("step_s", "step time median (s)", "{:.3f}"),
    ("setup_s", "launch → start of step 1 (s)", "{:.1f}"),
    ("rss_mb", "peak RSS (MB)", "{:.0f}"),
    ("loss", "final loss", "{:.4f}"),
    ("wall_s", "whole run (s)", "{:.1f}"),
]


def build_inputs(work: Path) -> None:
    """The tiny Llama (its attention dropout 0, as shipped), and the demo's first `ROWS` triplets."""
    model = work / "model"
    shutil.copytree(ROOT / "toolkit" / "assets" / "tiny-llama", model)
    if json.loads((model / "config.json").read_text()).get("attention_dropout", 0.0):
        raise SystemExit(f"{model}: attention dropout would make the two sides' draws differ")
    lines = (ROOT / "toolkit" / "assets" / "demo" / "embed_train.jsonl").read_text().splitlines()
    (work / "triplets.jsonl").write_text("\n".join(lines[:ROWS]) + "\n")


def commands(work: Path) -> dict[str, list[str]]:
    model, triplets, out = str(work / "model"), str(work / "triplets.jsonl"), work / "out"
    shared = (STEPS, ROWS, MAX_LENGTH, LEARNING_RATE)
    return {
        FTKIT: [
            PY,
            str(ROOT / "recipes" / "embed_llm.py"),
            "--config",
            str(BENCH / "ftkit-embed.yaml"),
            f"model.path={model}",
            f"data.train={triplets}",
            f"output_dir={out / 'ftkit'}",
            *(f"{key}={value}" for key, value in zip(FTKIT_KEYS, shared, strict=True)),
        ],
        ST: [PY, str(BENCH / "st_embed.py"), model, triplets, str(out / "st"), *map(str, shared)],
    }


FTKIT_KEYS = ("train.max_steps", "train.global_batch_size", "data.max_length", "train.learning_rate")


def run_once(name: str, cmd: list[str], work: Path) -> dict:
    run = run_process(name, cmd, work)
    if name == FTKIT:
        lines = [x for x in read_metrics(work / "out" / "ftkit" / "metrics.jsonl") if "tokens_per_s" in x]
        ends = [x["time"] for x in lines]
        tokens = [round(x["tokens_per_s"] * x["step_time_s"]) for x in lines]
        losses = [x["loss"] for x in lines]
        begin = ends[0] - lines[0]["step_time_s"]
    else:
        record = json.loads((work / "stats.json").read_text())
        ends, tokens, losses = record["step_end"], record["tokens"], record["losses"]
        begin = record["first_step_begin"]
    return {**step_figures("tokens_per_s", ends, tokens, losses[-1], begin, run), "losses": losses}


def curves(results: dict[str, list[dict]]) -> str:
    """The first runs' losses at a few steps, side by side, and how far apart they lie."""
    ours, theirs = results[FTKIT][0]["losses"], results[ST][0]["losses"]
    lines = ["| step | ftkit loss | sentence-transformers loss | difference |", "|---|---|---|---|"]
    for step in SHOWN_STEPS:
        a, b = ours[step - 1], theirs[step - 1]
        lines.append(f"| {step} | {a:.6f} | {b:.6f} | {abs(a - b):.1e} |")
    first = max(abs(a - b) for a, b in zip(ours[:5], theirs[:5], strict=True))
    every = max(abs(a - b) / b for a, b in zip(ours, theirs, strict=True))
    note = (
        f"Largest difference over the first 5 steps: {first:.1e}; over all {STEPS} steps, relative to "
        f"sentence-transformers' loss: {every:.1e}."
    )
    return "\n".join(lines) + "\n\n" + note


def verdicts(results: dict[str, list[dict]]) -> str:
    """The ratios of the medians: tokens/s and peak memory, ftkit over sentence-transformers."""
    lines = []
    for key, what in (("tokens_per_s", "real tokens/s"), ("rss_mb", "peak RSS")):
        mine, other = (statistics.median(r[key] for r in results[name]) for name in (FTKIT, ST))
        lines.append(
            f"- {what}: ftkit {mine:.4g} against sentence-transformers {other:.4g}, ratio {mine / other:.3f}"
        )
    return "\n".join(lines)


def run_section(repeats: int, machine) -> str:
    """Both contenders `repeats` times round-robin; returns the markdown block it also writes."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_inputs(work)
        results = round_robin("embed", commands(work), repeats, lambda n, c: run_once(n, c, work))
    head = (
        f"Machine: {machine()}. {repeats} runs of each contender; cells are min / median / max. "
        f"{ROWS} triplets a step (one hard negative), {STEPS} steps, up to {MAX_LENGTH} tokens a text, "
        f"learning rate {LEARNING_RATE:g}, full fine-tuning of the tiny Llama, mean pooling."
    )
    block = "\n\n".join([head, table(results, COLUMNS), verdicts(results), curves(results)])
    write_results(BENCH / "RESULTS.md", block, (BEGIN, END))
    (BENCH / "raw_embed.json").write_text(json.dumps({"machine": machine(), "runs": results}, indent=1))
    return block


if __name__ == "__main__":
    run_from_command_line(__doc__, run_section, repeats=3)
