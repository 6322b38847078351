"""Write toolkit/assets/tiny-llama-h80: the embedded demo model, its attention heads widened from 40 to 80,
computing the same function (to float rounding), so vLLM's CPU engine, which refuses head size 40 and takes
80, serves the demo model itself. With `--adapter IN OUT`, a LoRA adapter trained on tiny-llama (the GRPO
demo's SFT start) rewritten for the widened model, the same function too.

    python scripts/widen_heads.py                                  # the model (seconds)
    python scripts/widen_heads.py --adapter ADAPTER_DIR OUT_DIR    # an adapter trained on tiny-llama

How: each head's 40 dimensions go to 40 of the 80, the others stay zero in every query, key and value, so
they add nothing to any dot product and carry nothing out. Rotary embeddings pair dimension i with i + d/2 at
frequency theta^(-2i/d): pair i of a 40-wide head goes to pair 2i of an 80-wide one, which turns at the same
frequency. The queries are scaled by sqrt(2) because attention divides by sqrt(80) instead of sqrt(40).
"""

import argparse
import json
import math
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ASSETS = Path(__file__).resolve().parent.parent / "toolkit" / "assets"
SOURCE, TARGET = ASSETS / "tiny-llama", ASSETS / "tiny-llama-h80"
OLD, NEW = 40, 80
Q_SCALE = math.sqrt(NEW / OLD)


def placement() -> torch.Tensor:
    """Where each of a 40-wide head's dimensions goes in an 80-wide one (rotary pair i to pair 2i)."""
    half = OLD // 2
    return torch.tensor([2 * i for i in range(half)] + [NEW // 2 + 2 * i for i in range(half)])


def widen_rows(weight: torch.Tensor, heads: int, scale: float = 1.0) -> torch.Tensor:
    """A projection's output rows (heads x 40) placed into heads x 80, zero elsewhere."""
    wide = weight.new_zeros(heads, NEW, weight.shape[1])
    wide[:, placement()] = weight.view(heads, OLD, -1) * scale
    return wide.view(heads * NEW, -1)


def widen_columns(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The output projection's input columns (heads x 40) placed into heads x 80, zero elsewhere."""
    return widen_rows(weight.t(), heads).t().contiguous()


def widen(
    name: str, weight: torch.Tensor, config: dict, lora_part: str = "", scale_queries=True
) -> torch.Tensor:
    """`weight` (a model's, or with `lora_part` an adapter's lora_A or lora_B) for the widened heads; the
    queries' rows scaled by sqrt(2) unless `scale_queries` is off (their adapter's alpha carries it)."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    q_scale = Q_SCALE if scale_queries else 1.0
    rows = {"q_proj": (heads, q_scale), "k_proj": (kv_heads, 1.0), "v_proj": (kv_heads, 1.0)}
    for module, (count, scale) in rows.items():
        if f".{module}." in name and lora_part != "lora_A":  # lora_A reads the hidden state: unchanged
            return widen_rows(weight, count, scale)
    if ".o_proj." in name and lora_part != "lora_B":  # lora_B writes the hidden state: unchanged
        return widen_columns(weight, heads)
    return weight


def widen_model(target: Path = TARGET) -> None:
    config = json.loads((SOURCE / "config.json").read_text())
    assert config["head_dim"] == OLD, config["head_dim"]
    state = load_file(str(SOURCE / "model.safetensors"))
    wide = {name: widen(name, weight, config) for name, weight in state.items()}
    target.mkdir(parents=True, exist_ok=True)
    save_file(wide, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps({**config, "head_dim": NEW}, indent=2) + "\n")
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(SOURCE / name, target / name)
    print(f"wrote {target} (head size {NEW})")


def _check_ours(target: Path) -> None:
    """`target` is new, empty, or an adapter this script wrote before (for tiny-llama-h80): nothing else in
    it is overwritten."""
    if not target.exists() or not any(target.iterdir()):
        return
    settings = target / "adapter_config.json"
    base = json.loads(settings.read_text()).get("base_model_name_or_path") if settings.is_file() else None
    if base != str(TARGET.relative_to(ASSETS.parent.parent)):
        raise SystemExit(
            f"{target}: not an adapter this script wrote (for tiny-llama-h80); name a new folder"
        )


def widen_adapter(source: Path, target: Path, scale_queries: bool = True) -> None:
    config = json.loads((SOURCE / "config.json").read_text())
    settings = json.loads((source / "adapter_config.json").read_text())
    if settings.get("modules_to_save") or settings.get("use_dora"):
        raise SystemExit(f"{source}: only plain LoRA adapters are widened (no modules_to_save, no DoRA)")
    _check_ours(target)
    state = load_file(str(source / "adapter_model.safetensors"))
    part = lambda name: "lora_A" if ".lora_A." in name else "lora_B"  # noqa: E731
    wide = {name: widen(name, weight, config, part(name), scale_queries) for name, weight in state.items()}
    target.mkdir(parents=True, exist_ok=True)
    save_file(wide, str(target / "adapter_model.safetensors"), metadata={"format": "pt"})
    settings["base_model_name_or_path"] = str(TARGET.relative_to(ASSETS.parent.parent))
    (target / "adapter_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    print(f"wrote {target} (for {settings['base_model_name_or_path']})")


def widen_fresh_lora(seed: int, target: Path) -> None:
    """The fresh adapter a run with `seed` draws on tiny-llama (r 16, alpha 32, every linear layer: the GRPO
    demo's), widened, for lora.init_adapter: trained on the widened model it computes what it would on
    tiny-llama. Its B matrices are zero, so the queries' sqrt(2) goes to their alpha (alpha_pattern), not
    to B; the output projection's A reads zeros from the added dimensions. Then every gradient on an added
    row or column is exactly zero, and each update is the one tiny-llama's adapter would get."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from toolkit.config import LoraConfig
    from toolkit.model.load import peft_config

    demo = LoraConfig(r=16, alpha=32)
    model = AutoModelForCausalLM.from_pretrained(SOURCE, dtype=torch.float32)
    torch.manual_seed(seed)  # as a run with this seed does before it draws its adapter
    fresh = get_peft_model(model, peft_config(demo, model))
    with tempfile.TemporaryDirectory() as drawn:
        fresh.save_pretrained(drawn)
        widen_adapter(Path(drawn), target, scale_queries=False)
    settings = json.loads((target / "adapter_config.json").read_text())
    settings["alpha_pattern"] = {"q_proj": demo.alpha * Q_SCALE}
    (target / "adapter_config.json").write_text(json.dumps(settings, indent=2) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", nargs=2, metavar=("ADAPTER_DIR", "OUT_DIR"), type=Path)
    parser.add_argument("--fresh-lora", nargs=2, metavar=("SEED", "OUT_DIR"))
    args = parser.parse_args()
    try:
        if args.fresh_lora:
            if not args.fresh_lora[0].isdigit():
                parser.error(f"--fresh-lora: the seed must be a whole number, got {args.fresh_lora[0]!r}")
            widen_fresh_lora(int(args.fresh_lora[0]), Path(args.fresh_lora[1]))
        else:
            widen_adapter(*args.adapter) if args.adapter else widen_model()
    except SystemExit as exc:  # a refusal: one line, exit 2
        if not isinstance(exc.code, str):
            raise
        parser.error(exc.code)
