"""Build toolkit/assets/tiny-llama-q64: the embedded tokenizer on a second tiny Llama whose every quantized
width meets bitsandbytes' CPU 4-bit kernel (inputs a multiple of the 64-weight block, outputs of its 32-row
tile), so QLoRA runs, evaluates and generates on a CPU-only machine.

Run `python scripts/build_qlora_asset.py` (seconds). The weights are the fixed-seed initialisation, stored in
bfloat16 (the dtype QLoRA computes in), so the folder stays a few hundred KB; QLoRA tests measure
agreement between backends and with LoRA, which needs no pretrained knowledge.
"""

import shutil
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

ASSETS = Path(__file__).resolve().parent.parent / "toolkit" / "assets"
SOURCE, TARGET = ASSETS / "tiny-llama", ASSETS / "tiny-llama-q64"
SEED = 1234
# q/o: 64 -> 64, k/v: 64 -> 32, gate/up: 64 -> 128, down: 128 -> 64.
MODEL_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def build(target: Path = TARGET) -> None:
    """Write the model, its generation config and the embedded tokenizer to `target`."""
    source = LlamaConfig.from_pretrained(SOURCE)
    config = LlamaConfig(
        vocab_size=source.vocab_size,
        bos_token_id=source.bos_token_id,
        eos_token_id=source.eos_token_id,
        pad_token_id=source.pad_token_id,
        **MODEL_SHAPE,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    target.mkdir(exist_ok=True)
    model.save_pretrained(target)
    GenerationConfig.from_pretrained(SOURCE).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(SOURCE / name, target / name)


if __name__ == "__main__":
    build()
    print(f"wrote {TARGET} ({(TARGET / 'model.safetensors').stat().st_size / 1024:.0f} KB of weights)")
