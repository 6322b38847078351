"""GRPO's weight sync to the vLLM engine, each round: the LoRA adapter alone (written, hot-loaded under a
new name, the previous one unloaded: what a LoRA run does) against the merged full weights (the adapter
folded into the base, written as a checkpoint and reloaded in place: what a full fine-tune does, and what a
LoRA run would do if it sent merged weights). Both through the recipe's own sync code
(toolkit/grpo/engine.py), on tiny-llama-q64 and on tiny-llama-h80 (the engine demo's base, head size 80)
with a rank-16 adapter, float32, one engine per model serving both paths. Each sync is timed until its
call returned (the `sync_s` a run logs) and until the engine answered one token with the new weights.
Writes its table between the engine-sync markers of bench/RESULTS.md and the figures to
bench/raw_engine_sync.json (also run by `make bench`; skipped, saying so, without .venv-vllm).

    python bench/engine_sync.py [--repeats 5]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import ROOT, write_results
from harness import run_from_command_line
from safetensors.torch import save_file

from toolkit.engine import client
from toolkit.engine.server import BASE_NAME, ENGINE_VENV, Engine, ServeSpec
from toolkit.grpo.engine import EngineSampler

BENCH = Path(__file__).resolve().parent
BEGIN, END = "<!-- make bench engine-sync: begin -->", "<!-- make bench engine-sync: end -->"
MODELS = ("tiny-llama-q64", "tiny-llama-h80")
RANK = 16


def policy(path: Path):
    """The base with a rank-16 adapter whose B is not zero (a trained adapter's shape and cost)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return model.eval()


def answered(engine: Engine, name: str) -> None:
    """One token from the model just synced: the sync is done when the engine samples with it."""
    client.post(engine.url, "/v1/completions", {"model": name, "prompt": [0], "max_tokens": 1})


def adapter_round(sampler: EngineSampler, model, index: int) -> tuple[float, float]:
    """(seconds the sync took, seconds until the engine answered with the new adapter)."""
    started = time.perf_counter()
    sampler._load(model, model.state_dict(), index)
    synced = time.perf_counter()
    answered(sampler.engine, sampler.adapter[0])
    return synced - started, time.perf_counter() - started


def merged_round(sampler: EngineSampler, model, index: int) -> tuple[float, float]:
    """The adapter folded into the base weights, those sent whole (the model left unmerged after): (seconds
    the merge and sync took, seconds until the engine answered with the new weights)."""
    started = time.perf_counter()
    model.merge_adapter()
    base = model.get_base_model()
    state = {k.replace(".base_layer", ""): v for k, v in base.state_dict().items() if "lora_" not in k}
    folder = sampler.folder / f"weights-round-{index}"
    folder.mkdir(parents=True, exist_ok=True)
    base.config.save_pretrained(str(folder))
    # What the recipe's sync writes: each tensor its own, the tied head too.
    tensors = {name: value.detach().clone().contiguous() for name, value in state.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    sampler._reload(folder)
    synced = time.perf_counter()
    model.unmerge_adapter()
    answered(sampler.engine, BASE_NAME)
    return synced - started, time.perf_counter() - started


def measure_model(name: str, repeats: int, work: Path) -> dict:
    """Adapter rounds first, then merged ones, on one engine; the first round of each not counted."""
    path = ROOT / "toolkit" / "assets" / name
    model = policy(path)
    spec = ServeSpec(str(path), "float32", 128, lora_rank=RANK, reloads_weights=True)
    engine = Engine.start(spec, work / f"{name}.log")
    sampler = EngineSampler(None, None, engine, work / name)
    figures = {"adapter_s": [], "adapter_answered_s": [], "merged_s": [], "merged_answered_s": []}
    try:
        figures["engine_start_s"] = engine.wait_ready(600)
        for path, sync in (("adapter", adapter_round), ("merged", merged_round)):
            for index in range(repeats + 1):
                seconds, answered_s = sync(sampler, model, index)
                if index:
                    figures[f"{path}_s"].append(seconds)
                    figures[f"{path}_answered_s"].append(answered_s)
    finally:
        engine.stop()
    figures["adapter_mb"] = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) * 4 / 1e6
    figures["weights_mb"] = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n) * 4 / 1e6
    return figures


def spread(values: list[float]) -> str:
    values = sorted(values)
    return f"{values[0]:.3f} / {statistics.median(values):.3f} / {values[-1]:.3f}"


def ratio(slow: list[float], fast: list[float]) -> float:
    return statistics.median(slow) / statistics.median(fast)


def run_section(repeats: int, machine) -> str:
    if not (ENGINE_VENV / "bin" / "python").is_file():
        return f"engine-sync: skipped, no engine environment at {ENGINE_VENV} (`make install-vllm`)"
    with tempfile.TemporaryDirectory() as tmp:
        figures = {name: measure_model(name, repeats, Path(tmp)) for name in MODELS}
    rows = [
        "| model | adapter / weights (MB) | timed until | adapter-only, s (min / median / max) | "
        "merged weights, s (min / median / max) | merged / adapter, medians |",
        "|---|---|---|---|---|---|",
    ]
    for name, runs in figures.items():
        for until, suffix in (("sync returned", "_s"), ("engine answered", "_answered_s")):
            rows.append(
                f"| {name} | {runs['adapter_mb']:.2f} / {runs['weights_mb']:.1f} | {until} | "
                f"{spread(runs['adapter' + suffix])} | {spread(runs['merged' + suffix])} | "
                f"{ratio(runs['merged' + suffix], runs['adapter' + suffix]):.1f}x |"
            )
    block = "\n".join(
        [
            f"Machine: {machine()}. {repeats} rounds of each path per model (one warm-up round each, not "
            f"counted), rank-{RANK} adapter, float32; each sync timed until its call returned, and until "
            "the engine answered one token with the new weights.",
            "",
            *rows,
        ]
    )
    write_results(BENCH / "RESULTS.md", block, (BEGIN, END))
    (BENCH / "raw_engine_sync.json").write_text(json.dumps({"machine": machine(), **figures}, indent=1))
    return block


if __name__ == "__main__":
    run_from_command_line(__doc__, run_section, repeats=5)
