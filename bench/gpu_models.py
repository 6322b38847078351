"""The GPU check's models and data, built offline: random-initialised models of real shapes (or, in smoke
mode, tiny ones of the same families) with the embedded tokenizer, and long chats of plain words."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
from common import TOKENIZER_DIR, sentences

LLAMA_VOCAB = 128256
SHAPES = {
    # Llama-3.2-1B and Llama-3.1-8B as published; Qwen3-30B-A3B's layer with 8 of its 48 layers.
    "llama-1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=LLAMA_VOCAB, tie_word_embeddings=True,
    ),
    "llama-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=LLAMA_VOCAB, tie_word_embeddings=False,
    ),
    "qwen3-moe": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, num_hidden_layers=8, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
    ),
}  # fmt: skip
# Smoke mode: the same families at widths bitsandbytes' CPU 4-bit kernel accepts (multiples of 64).
SMOKE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=2048, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, head_dim=16,
)  # fmt: skip


def build(name: str, out: Path, smoke: bool) -> Path:
    """Model `name` saved at `out`, in bfloat16 on a GPU. It is written to `out`.partial and renamed when
    whole, so a folder at `out` is always complete and is reused; a partial one left by a stopped run is
    the kit's own and is removed. Refused, in one line, where the disk cannot hold it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").is_file():
        return out
    shape = dict(SHAPES[name])
    model_type = shape.pop("model_type")
    if smoke:
        shape.update({k: v for k, v in SMOKE.items() if k in shape})
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = AutoConfig.for_model(model_type, **shape, **ids, pad_token_id=tokenizer.pad_token_id)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_disk(name, out.parent, config, dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(partial)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, partial / name)
    partial.rename(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


# Beyond the weights: the runs' checkpoints, adapters and logs, and the other parts' data.
DISK_SPARE_BYTES = 4 * 2**30


def check_disk(name: str, folder: Path, config, dtype: torch.dtype) -> None:
    """Stop, in one line, where `folder`'s disk cannot hold model `name` plus DISK_SPARE_BYTES."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    need = params * torch.empty((), dtype=dtype).element_size() + DISK_SPARE_BYTES
    free = shutil.disk_usage(folder).free
    if free < need:
        raise SystemExit(
            f"gpu-check: {folder} has {free / 2**30:.1f} GiB free, {name} needs {need / 2**30:.1f} GiB "
            "(its weights and room for the runs): free some disk or pass --work on a larger one"
        )


def write_chats(path: Path, tokens: int) -> Path:
    """Chats of plain words, long enough (a few hundred tokens each) and many enough (`tokens` in all, about)
    that packed rows of any checked length fill up."""
    from transformers import AutoTokenizer

    text = sentences(AutoTokenizer.from_pretrained(TOKENIZER_DIR))
    rng, written = random.Random(0), 0
    with path.open("w") as handle:
        while written < tokens:
            answer = text(rng.choice((150, 300, 600)), 0.5)
            messages = [{"role": "user", "content": text(20, 0.8)}, {"role": "assistant", "content": answer}]
            handle.write(json.dumps({"messages": messages}) + "\n")
            written += len(answer.split()) + 30
    return path
