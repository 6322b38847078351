"""Sections of peer accelerate YAMLs and DeepSpeed JSONs that ftkit cannot run, refused in one line.

Each function is pure: it takes the settings as read (from a YAML by `ftkit check-config`, or from the
environment `accelerate launch` sets), raises `UserError` naming the file and key, or returns nothing.
The launch check and `ftkit check-config` call the same functions, so they cannot disagree.
"""

from __future__ import annotations

from toolkit.errors import UserError

# accelerate's parallelism_config sizes (YAML key parallelism_config_<name>_size, env PARALLELISM_CONFIG_
# <NAME>_SIZE) -> why ftkit refuses a size above 1. Lifting one is deleting its entry.
UNSUPPORTED_PARALLELISM = {
    "cp": "context parallelism shards each sequence across ranks with ring attention, which needs CUDA "
    "SDPA kernels and a sequence-sharded batch the recipes do not build"
}
PARALLEL_SIZES = ("dp_replicate", "dp_shard", "tp", "cp", "sp")
# DeepSpeed accepts both spellings of this ZeRO-3 field, and refuses a config that sets both.
GATHER_KEYS = ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save")


def refuse_parallelism(sizes: dict[str, int], where: str) -> None:
    """Refuse any parallelism_config size above 1 that ftkit does not run, with the reason."""
    for name, reason in UNSUPPORTED_PARALLELISM.items():
        if sizes.get(name, 1) > 1:
            raise UserError(
                f"{where}: parallelism_config_{name}_size {sizes[name]} is refused: {reason}; remove it"
            )


def refuse_deepspeed_sections(ds_config: dict, stage: int, where: str) -> None:
    """Refuse DeepSpeed JSON sections and stages the recipes cannot train with."""
    if stage == 0:
        raise UserError(
            f"{where}: zero_optimization.stage 0 is refused (DeepSpeed's engine reports no gradient norm "
            "there): use stage 1, or accelerate_configs/ddp.yaml for plain data parallel"
        )
    compile_block = ds_config.get("compile")
    if isinstance(compile_block, dict) and not _switched_off(compile_block):
        raise UserError(
            f"{where}: the compile block is refused (DeepSpeed compiles its own engine, not the recipe's "
            "model): remove it and set model.compile=true instead"
        )
    autotp = (ds_config.get("tensor_parallel") or {}).get("autotp_size", 1)
    if int(autotp) > 1:
        raise UserError(
            f"{where}: tensor_parallel.autotp_size {autotp} is refused: DeepSpeed AutoTP is not supported "
            "yet; remove the tensor_parallel block"
        )
    zero = ds_config.get("zero_optimization") or {}
    if all(key in zero for key in GATHER_KEYS):
        raise UserError(
            f"{where}: zero_optimization sets both {GATHER_KEYS[0]} and {GATHER_KEYS[1]}, which DeepSpeed "
            f"refuses: keep one"
        )


def gather_setting(zero: dict) -> tuple[str, object]:
    """The spelling of the ZeRO-3 gather field a config uses (the long one when neither) and its value."""
    for key in GATHER_KEYS:
        if key in zero:
            return key, zero[key]
    return GATHER_KEYS[0], "auto"


def refuse_fsdp_settings(settings: dict[str, str], on_cpu: bool, where: str) -> None:
    """Refuse FSDP settings this machine cannot run."""
    if on_cpu and str(settings.get("offload_params", "false")).lower() == "true":
        raise UserError(
            f"{where}: fsdp_offload_params true moves parameters off a GPU and there is none here: set "
            "fsdp_offload_params: false"
        )


def refuse_unknown_wrap_classes(wanted: str, known: set[str] | None, model: str, where: str) -> None:
    """Refuse fsdp_transformer_layer_cls_to_wrap classes that are not among the model's own layers."""
    if not wanted or known is None:
        return
    missing = [name.strip() for name in wanted.split(",") if name.strip() and name.strip() not in known]
    if missing:
        layers = sorted(name for name in known if name.endswith("DecoderLayer")) or sorted(known)[:5]
        raise UserError(
            f"{where}: fsdp_transformer_layer_cls_to_wrap {', '.join(missing)} is not a layer of {model}: "
            f"use {', '.join(layers)} (or remove the key to wrap the model's own layers)"
        )


def _switched_off(block: dict) -> bool:
    """DeepSpeed blocks are off with `disable: true` (compile) or `enabled: false` (most others)."""
    return (
        str(block.get("disable", False)).lower() == "true"
        or str(block.get("enabled", True)).lower() == "false"
    )
