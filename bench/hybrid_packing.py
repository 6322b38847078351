"""A hybrid on variable-length chat rows: a Qwen3.5-shaped model (3 gated DeltaNet layers to 1 attention
layer, random init, on CPU: transformers' PyTorch delta rule) through the SFT recipe padded, with
`data.group_by_length` and packed (its DeltaNet layers run per example), same data, settings and global
batch; real (not padding) tokens/s. Round-robin repeats. Writes its table between the hybrid markers of
bench/RESULTS.md and every run's figures to bench/raw_hybrid.json (also run by `make bench`).

    python bench/hybrid_packing.py [--repeats 3]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from common import (
    BATCH,
    LEARNING_RATE,
    ROOT,
    SEED,
    SEQ_LEN,
    STEPS,
    TOKENIZER_DIR,
    step_figures,
    write_data,
    write_results,
)
from harness import BENCH, round_robin, run_from_command_line, run_process, table

from toolkit.train.metrics import read_metrics

BEGIN, END = "<!-- make bench hybrid: begin -->", "<!-- make bench hybrid: end -->"
LAYOUTS = {"padded": [], "group_by_length": ["data.group_by_length=true"], "packed": ["data.packing=true"]}


def build_qwen3_5(out: Path) -> None:
    """A random-init Qwen3.5 text model, 8 layers (6 gated DeltaNet, 2 attention), width 256."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    config = AutoConfig.for_model(
        "qwen3_5_text",
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=8,
        layer_types=["linear_attention"] * 3
        + ["full_attention"]
        + ["linear_attention"] * 3
        + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


def run_section(repeats: int, machine) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_qwen3_5(work / "model")
        write_data(work / "data.jsonl")
        recipe = [
            sys.executable,
            str(ROOT / "recipes" / "finetune_llm.py"),
            "--config",
            str(BENCH / "ftkit.yaml"),
        ]
        base = [
            *recipe,
            f"model.path={work / 'model'}",
            f"data.train={work / 'data.jsonl'}",
            f"output_dir={work / 'out'}",
            f"train.max_steps={STEPS}",
            f"train.global_batch_size={BATCH}",
            f"train.micro_batch_size={BATCH}",
            f"train.learning_rate={LEARNING_RATE}",
            f"data.max_length={SEQ_LEN}",
        ]
        cmds = {name: [*base, *extra] for name, extra in LAYOUTS.items()}
        results = round_robin("hybrid", cmds, repeats, lambda name, cmd: run_once(name, cmd, work))
    block = "\n\n".join(
        [f"Machine: {machine()}. {repeats} runs of each; cells are min / median / max.", table(results)]
    )
    write_results(BENCH / "RESULTS.md", block, (BEGIN, END))
    (BENCH / "raw_hybrid.json").write_text(json.dumps({"machine": machine(), "runs": results}, indent=1))
    return block


def run_once(name: str, cmd: list[str], work: Path) -> dict:
    run = run_process(name, cmd, work)
    lines = [x for x in read_metrics(work / "out" / "metrics.jsonl") if "tokens_per_s" in x]
    ends = [x["time"] for x in lines]
    tokens = [round(x["tokens_per_s"] * x["step_time_s"]) for x in lines]
    begin = ends[0] - lines[0]["step_time_s"]
    return step_figures("tokens_per_s", ends, tokens, lines[-1]["loss"], begin, run)


if __name__ == "__main__":
    run_from_command_line(__doc__, run_section, 3)
