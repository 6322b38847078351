"""QLoRA's 4-bit base: the bitsandbytes settings ftkit chooses, and the mistakes that would otherwise train
silently on wrong weights, refused before step 1 with one line each (pure functions, tested alone)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

BLOCK = 64
"""Weights per NF4 quantization block (one absmax each): bitsandbytes' default and the plan's assumption."""
CPU_TILE = 32
"""Output rows bitsandbytes' CPU 4-bit kernel packs together (its eval path's block_n)."""

STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MIXED_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def cast_dtype(backend: str, fsdp_version: int, mixed_precision: str) -> str | None:
    """The dtype a backend casts every parameter to, 4-bit weights included, or None where it casts none:
    FSDP2 and DeepSpeed under mixed precision. DDP's autocast casts activations, never parameters."""
    casts = backend == "deepspeed" or (backend == "fsdp" and fsdp_version == 2)
    return MIXED_DTYPES.get(mixed_precision) if casts else None


def storage_name(setting: str, cast: str | None) -> str:
    """model.quant_storage resolved: auto packs 4-bit weights into the dtype the backend casts parameters to
    (`cast`, from cast_dtype), so the cast leaves their bits alone; float32 where nothing casts."""
    return (cast or "float32") if setting == "auto" else setting


def quant_config(storage: torch.dtype, staged_on_cpu: bool = False, keep: list[str] | None = None):
    """NF4 with double quantization, computing in bf16, packed into `storage` (storage_name's choice, so a
    backend's parameter cast leaves the packed bits intact). `staged_on_cpu`: the device map loads some
    modules (a mixture of experts' fused experts) to CPU memory, which bitsandbytes then leaves alone.
    `keep`: modules left unquantized by name (a vision tower and projector; the output head with them)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        llm_int8_skip_modules=[*keep, "lm_head"] if keep else None,
        llm_int8_enable_fp32_cpu_offload=staged_on_cpu,
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=storage,
    )


def layer_widths(model_config: Mapping) -> dict[str, int]:
    """The widths a decoder's quantized linear layers take in and put out, by the config.json key that sets
    them (Llama-shaped configs: attention projections, MLP)."""
    heads = model_config["num_attention_heads"]
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // heads
    kv_heads = model_config.get("num_key_value_heads") or heads
    widths = {
        "hidden_size": model_config["hidden_size"],
        "intermediate_size": model_config.get("intermediate_size"),  # DeepSeek-V4 has experts only
        "num_attention_heads x head_dim": heads * head_dim,
        "num_key_value_heads x head_dim": kv_heads * head_dim,
    }
    if model_config.get("kv_lora_rank"):  # multi-head latent attention: its projections' own widths
        widths.update(_latent_attention_widths(model_config, heads))
    return {name: width for name, width in widths.items() if width}


def _latent_attention_widths(model_config: Mapping, heads: int) -> dict[str, int]:
    """Multi-head latent attention's widths (DeepSeek-V3, Kimi, Mistral-4): compressed queries and keys,
    expanded per head, and an output projection over the heads' values."""
    rope = model_config.get("qk_rope_head_dim") or 0
    nope = model_config.get("qk_nope_head_dim") or 0
    return {
        "num_attention_heads x head_dim": None,
        "num_key_value_heads x head_dim": None,
        "q_lora_rank": model_config.get("q_lora_rank"),
        "kv_lora_rank": model_config["kv_lora_rank"],
        "num_attention_heads x v_head_dim": heads * (model_config.get("v_head_dim") or 0),
        "kv_lora_rank + qk_rope_head_dim": model_config["kv_lora_rank"] + rope,
        "num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim)": heads * (nope + rope),
    }


def width_problem(widths: Mapping[str, int]) -> str | None:
    """Why a 4-bit base with these widths fails, or None.

    bitsandbytes' CPU kernel reshapes each layer's absmax to (out, in / BLOCK) and packs CPU_TILE output
    rows at a time: an input width BLOCK does not divide, or an output width CPU_TILE does not, raises a
    shape error at the first evaluation. It is refused on every machine, so a run checked on one behaves
    the same on another (real models meet it)."""
    inputs = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads x head_dim",
        "q_lora_rank",
        "kv_lora_rank",
        "num_attention_heads x v_head_dim",
    )
    for name, width in widths.items():
        if name in inputs and width % BLOCK:
            return f"{name} {width} is not a multiple of the 4-bit block size {BLOCK}"
        if width % CPU_TILE:
            return f"{name} {width} is not a multiple of {CPU_TILE} (bitsandbytes' 4-bit row tile)"
    return None


def storage_problem(storage: str, cast: str | None, backend: str) -> str | None:
    """Why packing 4-bit weights into `storage` breaks under `backend` (a name for messages) that casts every
    parameter to `cast`, or None. The cast reaches packed weights too: their bits become other numbers or,
    where the width changes, a shape error mid-run."""
    if cast is not None and storage != cast:
        return (
            f"model.quant_storage {storage} != {cast}, the dtype {backend} casts every parameter to: "
            f"set model.quant_storage: auto (or {cast})"
        )
    return None


def fsdp1_problem(fsdp_config: Mapping[str, object]) -> str:
    """Why FSDP1 cannot shard a 4-bit base under these fsdp_config settings (always a reason: the ones that
    break it are named first, and even without them FSDP1 QLoRA is not proven here, FSDP2 is)."""
    if str(fsdp_config.get("use_orig_params", "true")).lower() == "false":
        return (
            "fsdp_use_orig_params false flattens the 4-bit weights into one buffer and drops their "
            "quantization state"
        )
    if str(fsdp_config.get("cpu_ram_efficient_loading", "false")).lower() == "true":
        return (
            "fsdp_cpu_ram_efficient_loading true sends rank 0's packed weights to ranks whose layers never "
            "received the quantization state"
        )
    return "FSDP1 QLoRA is not proven here"


def keep_training_layout(model) -> None:
    """Switch off bitsandbytes' CPU eval-mode repacking on every 4-bit layer: once an evaluation has
    repacked a weight, later training steps run a kernel without a backward and the gradients reaching
    earlier layers are silently wrong. Evaluation then dequantizes as training does."""
    from bitsandbytes.nn import Linear4bit

    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False


def bf16_names(model) -> set[str]:
    """The bf16 parameters peft's `prepare_model_for_kbit_training` will turn to fp32: every one but the
    packed 4-bit weights."""
    packed = packed_names(model)
    return {name for name, p in model.named_parameters() if p.dtype == torch.bfloat16 and name not in packed}


def keep_bf16_stream(model, names: set[str]) -> None:
    """Undo peft's fp32 upcast of the parameters `names` (from `bf16_names`): embeddings and norms back in
    bf16, as under LoRA. Left in fp32, they make the residual stream fp32, and bitsandbytes' 4-bit layers
    return their input's dtype, so every activation would be fp32: on one H200, a Llama-3.2-1B-shaped
    QLoRA run (4 x 2048 tokens) peaked at 24.7 GB against LoRA's 19.3 GB. fp16 models keep the upcast
    (fp16 norms overflow)."""
    for name, param in model.named_parameters():
        if name in names and param.dtype == torch.float32:
            param.data = param.data.to(torch.bfloat16)


PACKED_EXPERTS = "original"
"""The name torch's parametrization gives a 4-bit experts tensor's stored bytes (quant_experts):
`<experts>.parametrizations.<tensor>.original`."""


def is_packed_experts(name: str) -> bool:
    """Whether a parameter's (or a saved weight's) name is that of 4-bit experts' stored bytes."""
    return ".parametrizations." in name and name.endswith(f".{PACKED_EXPERTS}")


def packed_names(model) -> set[str]:
    """Names of the parameters holding packed 4-bit weights (linear layers' and experts'): their storage
    dtype's values are bit patterns, not numbers, so a finiteness check must leave them out."""
    names = {name for name, _ in model.named_parameters() if is_packed_experts(name)}
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return names
    linear = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, Linear4bit)}
    return names | linear


def packed_keys(weights: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple]) -> set[str]:
    """The keys of saved `weights` holding packed 4-bit weights: their saved shape (two weights a byte, in
    one column) differs from the unquantized model's `shapes`, or they are 4-bit experts' bytes."""
    reshaped = {k for k, v in weights.items() if k in shapes and tuple(v.shape) != tuple(shapes[k])}
    return reshaped | {k for k in weights if is_packed_experts(k)}
