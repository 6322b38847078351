"""Checkpoints that outlive their launch: read the full weights of a checkpoint written under any backend
on one CPU process (no process group), and resume a run under another backend or world size.

Three layouts exist, one per kind of writer behind `accelerator.save_state`:

    replicated   single process / DDP: model.safetensors, optimizer.bin (both complete, on rank 0)
    dcp          FSDP sharded state, and tensor-parallel states (split.py): pytorch_model_fsdp_0/ and
                 optimizer_0/ (torch.distributed.checkpoint)
    deepspeed    ZeRO-1/2/3: pytorch_model/ (DeepSpeed's own partitions, read with its zero_to_fp32)

All three also hold scheduler.bin and random_states_<rank>.pkl, written by accelerate alone.
"""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file

from toolkit.checkpoint import moments, read_marker, safe_load
from toolkit.checkpoint.split import DCP_MODEL, DCP_OPTIMIZER
from toolkit.errors import UserError
from toolkit.model import quant
from toolkit.pipeline import stages
from toolkit.train.nonfinite import nonfinite_names, refuse_nonfinite

REPLICATED_MODEL, REPLICATED_OPTIMIZER = "model.safetensors", "optimizer.bin"
DEEPSPEED_TAG = "pytorch_model"
SCHEDULER = "scheduler.bin"
MESH_DEFAULTS = {"tp_size": 1, "dp_replicate_size": 1, "pp_size": 1, "ep_size": 1}


def checkpoint_layout(path: Path) -> str:
    """replicated | dcp | deepspeed: which writer's files `path` holds."""
    if (path / REPLICATED_MODEL).is_file():
        return "replicated"
    if (path / DCP_MODEL).is_dir():
        return "dcp"
    if (path / DEEPSPEED_TAG).is_dir():
        return "deepspeed"
    raise UserError(
        f"{path}: unknown checkpoint layout (none of {REPLICATED_MODEL}, {DCP_MODEL}/, {DEEPSPEED_TAG}/)"
    )


def read_weights(path: Path, packed=None) -> Mapping[str, torch.Tensor]:
    """The full model state (names as in the unwrapped model's state_dict), on CPU, in one copy (ZeRO's
    read a tensor at a time, when asked for). `packed` (weights -> names) names 4-bit packed weights, whose
    bit patterns the finiteness check leaves alone."""
    read_marker(path)
    check_pickles(path)
    layout = checkpoint_layout(path)
    if layout == "replicated":
        weights = load_file(path / REPLICATED_MODEL)
    else:
        weights = _read_dcp(path / DCP_MODEL, "model.") if layout == "dcp" else _read_zero(path)
    skipped = packed(weights) if packed else set()
    refuse_nonfinite(path, nonfinite_names((k, v) for k, v in weights.items() if k not in skipped))
    return weights


def check_pickles(path: Path) -> None:
    """Refuse a checkpoint whose DeepSpeed or DCP pickles need more than plain data (see safe_load)."""
    layout = checkpoint_layout(path)
    if layout == "deepspeed":
        safe_load.check_deepspeed(path / DEEPSPEED_TAG)
    elif layout == "dcp":
        for directory in (path / DCP_MODEL, path / DCP_OPTIMIZER):
            if directory.is_dir():
                safe_load.check_dcp(directory)


def read_optimizer_moments(path: Path, model, optimizer) -> moments.Moments | None:
    """Per-parameter optimizer state by parameter name for `optimizer` (built for `model`, not yet
    prepared), or None where the checkpoint's cannot be told apart by name (an optimizer.bin of an
    optimizer grouped otherwise)."""
    layout = checkpoint_layout(path)
    if layout == "replicated":
        if not (path / REPLICATED_OPTIMIZER).is_file():
            return None
        saved = torch.load(path / REPLICATED_OPTIMIZER, weights_only=True, map_location="cpu", mmap=True)
        return moments.positional(saved, model, optimizer)
    if layout == "deepspeed":
        return moments.read_zero(path / DEEPSPEED_TAG)
    directory, prefix = path / DCP_OPTIMIZER, "optimizer.state."
    keys: dict[str, list[str]] = {}
    for key in _dcp_tensor_keys(directory, prefix):
        keys.setdefault(key.removeprefix(prefix).rpartition(".")[0], []).append(key)

    def cut(name: str) -> dict[str, torch.Tensor]:
        found = _read_dcp(directory, prefix, keys[name])
        return {key.rpartition(".")[2]: tensor for key, tensor in found.items()}

    return moments.OnDemand({name: functools.partial(cut, name) for name in keys})


def resume_plan(marker: dict, current: dict) -> str:
    """exact: `accelerator.load_state` restores everything (the layout's own files); portable: weights and
    schedule through `restore_portable` before prepare, optimizer moments by name (`moments`).

    `current` is `checkpoint.layout(accelerator)`. Replicated layouts (single, DDP) hold complete model
    and optimizer states, so they load exactly at any world size; sharded ones only into their own layout.
    """
    if all(_whole(layout) for layout in (marker, current)):
        return "exact"
    # Markers written before the ZeRO stage (mesh) was recorded: unknown under DeepSpeed, 0 (1) elsewhere.
    saved = {"zero_stage": None if marker["backend"] == "DEEPSPEED" else 0, **MESH_DEFAULTS, **marker}
    keys = ("backend", "world_size", "zero_stage", *MESH_DEFAULTS)
    now = {**MESH_DEFAULTS, **current}
    return "exact" if all(saved[key] == now[key] for key in keys) else "portable"


def restore_portable(path: Path, model, optimizer, scheduler) -> moments.Moments | None:
    """Load a checkpoint from another layout into the model and scheduler built for this run, and read its
    optimizer moments by name (None where they cannot be named) for the caller to place: `moments.into_plain`
    before `prepare` where `plain_optimizer(current)`, else `moments.into_prepared` after it.

    Call it before `accelerator.prepare`, on every process, while the model is a plain module.
    """
    weights = read_weights(path, lambda weights: quant.packed_names(model))
    if stages.is_part(model):  # a pipeline stage takes its own layers from the whole model's weights
        weights = {name: weights[name] for name in model.state_dict() if name in weights}
    load_weights(model, weights)
    restore_schedule(scheduler, optimizer, torch.load(path / SCHEDULER, weights_only=True))
    return read_optimizer_moments(path, model, optimizer)


def plain_optimizer(current: dict) -> bool:
    """Whether the optimizer keeps training the parameters it holds before `prepare` (FSDP and DeepSpeed
    swap them for shards or flat partitions)."""
    return _replicated(current["backend"])


def carried(path: Path, current: dict, placed: bool) -> str:
    """The one line a portable resume prints: what was carried over, or that the moments restart."""
    source = f"a {describe(read_marker(path))} checkpoint"
    if placed:
        return f"resumed weights, optimizer and learning-rate schedule from {source} on {describe(current)}"
    return (
        f"warning: optimizer moments restart: the optimizer state of {source} does not load under "
        f"{describe(current)}; weights, learning-rate schedule and data position resumed"
    )


def restore_schedule(scheduler, optimizer, saved: dict) -> None:
    """Continue a LambdaLR schedule at its saved position, on this run's own parameter groups, peak rates
    and schedule (another backend may group parameters differently, another world size may scale the peak,
    and a resumed run may change its schedule)."""
    scheduler.last_epoch, scheduler._step_count = saved["last_epoch"], saved["_step_count"]
    lrs = [
        base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)
    ]
    scheduler._last_lr = lrs
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy `weights` into `model`, also where ZeRO-3 already partitioned it at construction or tensor
    parallelism split it."""
    # ZeRO-3 keeps parameters and buffers only: a 4-bit base's quantization state (absmax, maps) is not in
    # its checkpoint, and the frozen base this run just quantized from the same file already holds it.
    packed = tuple(f"{name}." for name in quant.packed_names(model))
    expected = {name for name in model.state_dict() if name in weights or not name.startswith(packed)}
    if expected != set(weights):
        missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise UserError(
            f"checkpoint does not fit the model built from its config: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    partitioned = {name: p for name, p in model.named_parameters() if hasattr(p, "ds_id")}
    if partitioned:
        import deepspeed

        for name, param in partitioned.items():
            # Each process holds every weight, so each writes the same values into the gathered tensor.
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
                param.copy_(weights[name])
    current = model.state_dict()
    whole = {k: moments.like(current[k], v) for k, v in weights.items() if k not in partitioned}
    model.load_state_dict(whole, strict=False)


def describe(layout: dict) -> str:
    """e.g. `DEEPSPEED ZeRO-2 world 2`, `MULTI_CPU world 1` or `FSDP world 4 tp 2`."""
    zero = f" ZeRO-{layout['zero_stage']}" if layout.get("zero_stage") else ""
    mesh = "".join(
        f" {key.removesuffix('_size')} {layout[key]}" for key in MESH_DEFAULTS if layout.get(key, 1) > 1
    )
    return f"{layout['backend']}{zero} world {layout['world_size']}{mesh}"


def _replicated(backend: str) -> bool:
    return backend == "NO" or backend.startswith("MULTI_")


def _whole(layout: dict) -> bool:
    """Every weight and optimizer state whole on rank 0 (single process, DDP): loads at any world size."""
    split = layout.get("tp_size", 1), layout.get("pp_size", 1), layout.get("ep_size", 1)
    return _replicated(layout["backend"]) and split == (1, 1, 1)


def _dcp_tensor_keys(directory: Path, prefix: str) -> dict[str, object]:
    """key -> its tensor metadata, for every tensor under `prefix` in a torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        key: meta
        for key, meta in dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }


def _read_dcp(directory: Path, prefix: str, only: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors under `prefix` (those in `only`, when given) of a torch.distributed.checkpoint
    directory, whole, without a process group."""
    import torch.distributed.checkpoint as dcp

    metas = _dcp_tensor_keys(directory, prefix)
    wanted = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metas.items()
        if only is None or key in only
    }
    with warnings.catch_warnings():
        # Reading without a process group is the point here, not an accident worth a warning.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(wanted, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=True)
    return {key.removeprefix(prefix): tensor for key, tensor in wanted.items()}


def _read_zero(path: Path) -> moments.OnDemand:
    """ZeRO's fp32 weights by name, each gathered from the ranks' memory-mapped partitions when asked for
    (DeepSpeed's lazy mode), so no process holds them all unless it keeps them all."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # The helper reports each stage on stdout; a caller prints its own summary instead.
    with contextlib.redirect_stdout(io.StringIO()):
        lazy = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DEEPSPEED_TAG, lazy_mode=True)
    return moments.OnDemand({name: _reader(tensor) for name, tensor in lazy.items()})


def _reader(tensor):
    """A whole tensor as it is (buffers, ZeRO-2's views), a ZeRO-3 gathered one when read."""
    return (lambda: tensor) if isinstance(tensor, torch.Tensor) else tensor.contiguous
