"""DeepSpeed ZeRO launches: the settings accelerate passes on, the JSON a YAML points to, and the plugin
that fills every "auto" field from the recipe."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from toolkit.config import TrainConfig
from toolkit.errors import UserError
from toolkit.launch.sections import gather_setting

# Accelerate-native DeepSpeed settings: env variable `accelerate launch` sets -> the YAML key it came from.
DS_SETTINGS_ENV = {
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "zero_stage",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "gradient_accumulation_steps",
    "ACCELERATE_GRADIENT_CLIPPING": "gradient_clipping",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "offload_optimizer_device",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "offload_param_device",
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "zero3_save_16bit_model",
}


def read_ds_config(path: str, source: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"DeepSpeed config {path} (deepspeed_config_file in {source}) not found")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def zero_stage(ds_config: dict, settings: dict) -> int:
    """The JSON's ZeRO stage, else the accelerate-native setting, else 2 (accelerate's default)."""
    return int(ds_config.get("zero_optimization", {}).get("stage", settings.get("zero_stage", 2)))


def offloads(ds_config: dict, settings: dict) -> bool:
    """The JSON or the accelerate-native settings move optimizer state or parameters off the GPU."""
    zero = ds_config.get("zero_optimization", {})
    devices = [zero.get(key, {}).get("device") for key in ("offload_optimizer", "offload_param")]
    devices += [settings.get(key) for key in ("offload_optimizer_device", "offload_param_device")]
    return any(str(device).lower() not in ("none", "") for device in devices if device is not None)


def deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def deepspeed_plugin(train: TrainConfig, grad_accum_steps: int, sequence_parallel: int = 1):
    """The launched DeepSpeed settings, each "auto" batch, accumulation and clipping field from the recipe.

    Accelerate alone would fill `gradient_clipping: auto` with 1.0 whatever the recipe says, and leave
    ZeRO-3 unable to gather a full state dict; the Accelerator fills precision from its mixed_precision.
    Under sequence parallelism the config says its size: ZeRO-3's sharded model construction checks the
    global batch against the data-parallel processes (all of them / sp) before the engine exists.
    """
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(
        gradient_accumulation_steps=grad_accum_steps,
        gradient_clipping=train.max_grad_norm,
        zero3_save_16bit_model=True,
    )
    config = plugin.deepspeed_config
    for key, value in (
        ("train_micro_batch_size_per_gpu", train.micro_batch_size),
        ("train_batch_size", train.global_batch_size),
    ):
        if config.get(key, "auto") == "auto":
            config[key] = value
    if sequence_parallel > 1:
        config["sequence_parallel_size"] = sequence_parallel
    zero = config["zero_optimization"]
    key, value = gather_setting(zero)
    if value == "auto":
        zero[key] = True
    return plugin


def fill_width_settings(plugin, hidden_size: int) -> None:
    """ZeRO's "auto" bucket and persistence sizes from the language model's width, as accelerate derives
    them from `config.hidden_size`, which a vision-language model's config does not have at its top."""
    zero = plugin.deepspeed_config.get("zero_optimization", {})
    sizes = {
        "reduce_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
    }
    for key, value in sizes.items():
        if zero.get(key) == "auto":
            zero[key] = value
