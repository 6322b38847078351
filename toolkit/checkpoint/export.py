"""Write the trained result as Hugging Face files (a PEFT adapter or a full model, safetensors), check
what was written, and optionally merge an adapter into a standalone model."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoTokenizer

from toolkit.checkpoint import split
from toolkit.distributed import agreed_error, unwrap
from toolkit.errors import UserError
from toolkit.model import backbone, quant, scalar, vision
from toolkit.model.load import DTYPES, model_class
from toolkit.pipeline import runtime, stages

ADAPTER_CONFIG = "adapter_config.json"
SAVED_WHOLE = ".modules_to_save.default."
"""Where peft keeps the trained copy of a module an adapter saves whole (a vision projector)."""
# A run that began from a trained adapter (model.adapter) folded it into its base, so the adapter it trains
# applies on top of that one: a copy travels with the export and every loader folds it in first.
START_ADAPTER = "start_adapter"


def export_model(accelerator, model, tokenizer, out_dir: Path, dtype: str) -> None:
    """Collective: gathers the full state dict (sharded backends included) and writes it on the main rank.
    A failed write (disk full, permissions) leaves no partial files and raises UserError on every rank."""
    state_dict = full_state_dict(accelerator, model)
    error = ""
    if accelerator.is_main_process:
        if dtype != "auto":
            state_dict = {
                k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in state_dict.items()
            }
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        try:
            _write_export(saver(accelerator, model), state_dict, tokenizer, tmp, out_dir)
        except (OSError, SafetensorError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"{out_dir}: model not exported: {getattr(exc, 'strerror', None) or exc}"
    error = agreed_error(accelerator, error)
    if error:
        raise UserError(error)


def _write_export(model, state_dict: dict, tokenizer, tmp: Path, out_dir: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    vision.current_layout_only(model)
    model.save_pretrained(str(tmp), state_dict=state_dict)
    tokenizer.save_pretrained(str(tmp))
    vision.copy_processor_files(Path(tokenizer.name_or_path), tmp)
    verify_export(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def full_state_dict(accelerator, model) -> dict[str, torch.Tensor]:
    """Collective: every weight, whole, on the main rank at least.

    On CPU processes FSDP1's own gather (accelerate's path) crashes moving the gathered weights to
    host memory that is already where they are; torch's state-dict API gathers them in place.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp1_on_cpu = isinstance(model, FullyShardedDataParallel) and accelerator.device.type == "cpu"
    if fsdp1_on_cpu or split.is_split(accelerator):  # accelerate's path keeps split weights split
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=False)
        state = get_model_state_dict(model, options=options)
        return runtime.whole_state_dict(accelerator, state) if stages.is_part(model) else state
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        return accelerator.get_state_dict(model)
    return unwrap(accelerator, model).state_dict()  # accelerate's path for the others, without DeepSpeed


def saver(accelerator, model) -> torch.nn.Module:
    """The model whose save_pretrained writes the gathered state dict.

    PEFT picks adapter weights by the module names it sees, and FSDP1's wrapped layers insert
    `_fsdp_wrapped_module` into them, and a pipeline stage holds some layers only: an adapter saved from
    the unwrapped model would come out empty or partial, so it is saved from the same adapter on a
    weightless copy of the base model.
    """
    from peft import PeftModel, get_peft_model
    from torch.distributed.fsdp import FullyShardedDataParallel

    unwrapped = unwrap(accelerator, model)
    renamed = isinstance(model, FullyShardedDataParallel) or stages.is_part(unwrapped)
    if not (renamed and isinstance(unwrapped, PeftModel)):
        return unwrapped
    base = unwrapped.get_base_model()
    name = unwrapped.active_adapter
    with torch.device("meta"):
        return get_peft_model(type(base)(base.config), unwrapped.peft_config[name], adapter_name=name)


def verify_export(path: Path, trust_remote_code: bool = False) -> int:
    """Check that every saved tensor is non-empty and matches, by name and shape, the model the files
    describe (built on the meta device, so no second copy of the weights is loaded). Returns the
    number of tensors checked."""
    saved = _saved_shapes(path)
    if not saved:
        raise RuntimeError(f"{path}: no tensors were written")
    empty = [name for name, shape in saved.items() if 0 in shape]
    if empty:
        raise RuntimeError(f"{path}: empty tensors written: {', '.join(empty[:5])}")
    expected, tied = _expected_shapes(path, trust_remote_code)
    if (path / ADAPTER_CONFIG).is_file():
        expected = {_adapter_key(k): v for k, v in expected.items() if "lora_" in k or SAVED_WHOLE in k}
        saved = {_adapter_key(k): v for k, v in saved.items()}
    missing = set(expected) - set(saved) - tied
    wrong = {k for k in set(saved) & set(expected) if tuple(saved[k]) != tuple(expected[k])}
    if missing or wrong or set(saved) - set(expected):
        raise RuntimeError(
            f"{path}: written tensors do not match the model: missing {sorted(missing)[:3]}, "
            f"wrong shape {sorted(wrong)[:3]}, unexpected {sorted(set(saved) - set(expected))[:3]}"
        )
    return len(saved)


def keep_start_adapter(out_dir: Path, start: str) -> None:
    """Copy the adapter a run started from (its config and weights) into an exported adapter."""
    (out_dir / START_ADAPTER).mkdir()
    for name in (ADAPTER_CONFIG, "adapter_model.safetensors"):
        shutil.copyfile(Path(start) / name, out_dir / START_ADAPTER / name)


def adapted_base(adapter_dir: Path, trust_remote_code: bool = False, **kwargs):
    """The model an exported adapter applies to: its base, with the run's start adapter folded in (and a
    reward model's scalar head, which the adapter carries)."""
    from peft import PeftModel

    base_path = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    head = scalar.saved_scalar(adapter_dir)
    if head:
        kwargs = {**scalar.head_settings(adapter_dir), **kwargs}
    cls = model_class(base_path, head, bare=backbone.saved_bare(adapter_dir))
    base = cls.from_pretrained(base_path, trust_remote_code=trust_remote_code, **kwargs)
    if (adapter_dir / START_ADAPTER).is_dir():
        start = adapter_dir / START_ADAPTER
        base = PeftModel.from_pretrained(
            base, str(start), **scalar.adapter_settings(base, start)
        ).merge_and_unload()
    return base


def merge_adapter(
    adapter_dir: Path, out_dir: Path, dtype: str, trust_remote_code: bool = False, dequantized: bool = False
) -> None:
    """Fold a LoRA adapter into its base model and save a standalone model (one copy of the base, CPU).
    `dequantized` (QLoRA): the base is the 4-bit one the adapter was trained on, dequantized, so the merged
    model computes what training saw; written in `dtype` (auto: float32)."""
    from peft import PeftModel

    torch_dtype = DTYPES[dtype] if dtype != "auto" else "auto"
    with outside_zero3():
        if dequantized:
            torch_dtype = torch.float32 if dtype == "auto" else torch_dtype
            base = adapted_base(
                adapter_dir,
                trust_remote_code,
                dtype=torch_dtype,
                quantization_config=quant.quant_config(torch.uint8),
                device_map={"": "cpu"},
            ).dequantize(dtype=torch_dtype)
            from toolkit.model import quant_experts  # brings peft: only for a 4-bit merge

            quant_experts.round_trip(base)  # the fused experts, which trained stored in 4-bit too
        else:
            base = adapted_base(adapter_dir, trust_remote_code, dtype=torch_dtype)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(str(adapter_dir)).save_pretrained(str(out_dir))
    vision.copy_processor_files(adapter_dir, out_dir)
    verify_export(out_dir, trust_remote_code)


def write_folded_base(model_path: str, adapter: str, out_dir: Path, dtype: str, trust_remote_code=False):
    """The base with a run's start adapter folded in, as a model folder (weights, config, tokenizer) another
    program serves: the very weights the run's base has (the same load and peft merge as
    toolkit/model/load.py's merge_start_adapter, in the same dtype), built on this process alone."""
    from peft import PeftModel

    if not (Path(adapter) / ADAPTER_CONFIG).is_file():
        raise UserError(f"model.adapter: {adapter} is not an adapter directory (no {ADAPTER_CONFIG})")
    with outside_zero3():
        base = model_class(model_path).from_pretrained(
            model_path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code
        )
        folded = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    folded.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code).save_pretrained(str(tmp))
    shutil.rmtree(out_dir, ignore_errors=True)  # an earlier launch's, written here the same way
    tmp.rename(out_dir)


@contextlib.contextmanager
def outside_zero3():
    """Build a model on this process alone, even inside a ZeRO-3 run.

    Under ZeRO-3 transformers partitions every model it builds across ranks, a collective; the main
    process building one by itself (to check or merge an export) would wait forever for the others.
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def _saved_shapes(path: Path) -> dict[str, list[int]]:
    shapes = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                shapes[name] = handle.get_slice(name).get_shape()
    return shapes


def _expected_shapes(path: Path, trust_remote_code: bool) -> tuple[dict[str, tuple], set[str]]:
    """Names and shapes of the model's state (adapter included), plus the names of tied duplicates."""
    is_adapter = (path / ADAPTER_CONFIG).is_file()
    if is_adapter:
        from peft import PeftConfig, get_peft_model

        peft_config = PeftConfig.from_pretrained(str(path))
        config = AutoConfig.from_pretrained(
            peft_config.base_model_name_or_path, trust_remote_code=trust_remote_code
        )
    else:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    head = scalar.saved_scalar(path)
    if head:
        config.num_labels = scalar.saved_labels(path)
    if backbone.saved_bare(path):
        cls = backbone.auto_class()
    else:
        cls = scalar.auto_class() if head else vision.auto_class(config.model_type)
    with torch.device("meta"), outside_zero3():
        model = cls.from_config(config, trust_remote_code=trust_remote_code)
        if is_adapter:
            peft_config.inference_mode = False
            model = get_peft_model(model, peft_config).base_model.model
    unique = {name for name, _ in model.named_parameters()}
    every = dict(model.named_parameters(remove_duplicate=False))
    buffers = {name: b for name, b in model.named_buffers() if _persistent(model, name)}
    state = {**every, **buffers} if is_adapter else _as_saved(model, {**every, **buffers})
    return {name: tuple(p.shape) for name, p in state.items()}, set(every) - unique


def _as_saved(model, state: dict) -> dict:
    """`state` under the names and shapes `save_pretrained` writes: transformers 5 saves some families in
    their hub layout (a mixture of experts' fused expert tensors split back into one weight per expert)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4 keeps the layout it loads
        return state
    return revert_weight_conversion(model, state)


def _adapter_key(name: str) -> str:
    """PEFT drops the adapter name and wraps keys in base_model.model when saving, and saves a module
    trained whole (modules_to_save) under its own name; compare without all three."""
    return name.removeprefix("base_model.model.").replace(SAVED_WHOLE, ".").replace(".default", "")


def _persistent(model: torch.nn.Module, name: str) -> bool:
    module_name, _, buffer_name = name.rpartition(".")
    return buffer_name not in model.get_submodule(module_name)._non_persistent_buffers_set
