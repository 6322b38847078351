"""The collectives the training core shares on every backend: clipping with the global norm, gathering the
FSDP root's weights for generation, agreeing on flags and error text across ranks, ending the training
(the process group kept), and the model inside the backend's wrapper.
How the backend itself is chosen and set up lives in toolkit/launch/."""

from __future__ import annotations

import contextlib
import math

import torch
from accelerate.utils import DistributedType, has_compiled_regions, is_compiled_module
from torch.distributed.tensor import DTensor


def clip_grad_norm(accelerator, model, max_norm: float) -> torch.Tensor | float:
    """Clip gradients to `max_norm` (0: none) and return the global norm before clipping, on every backend.

    Call it on every process after `accelerator.backward` on a step where `accelerator.sync_gradients` is
    true. Under DeepSpeed the engine has already clipped (to train.max_grad_norm) and stepped inside
    `backward`, and this returns the norm it measured, a float; elsewhere a tensor, so that `float()` on it
    can wait for a logging step.
    """
    limit = max_norm if max_norm > 0 else math.inf
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    split = [g for g in grads if isinstance(g, DTensor)]
    if split and len(split) < len(grads):  # expert parallelism: split experts beside replicated weights
        accelerator.unscale_gradients()
        return _clip_mixed(grads, limit)
    norm = accelerator.clip_grad_norm_(model.parameters(), limit)
    if norm is None:
        raise RuntimeError("no gradient norm: call clip_grad_norm after accelerator.prepare and backward")
    # FSDP2 returns a DTensor; gathering it is a collective, so do it here where every process is.
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _clip_mixed(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ over whole and split gradients together, which torch's refuses to mix: the
    split ones' squares are summed over every process (each holds other parts)."""
    split = [g for g in grads if isinstance(g, DTensor)]
    whole = [g for g in grads if not isinstance(g, DTensor)]
    square = sum((g.float().pow(2).sum() for g in whole), torch.zeros((), device=grads[0].device))
    split_square = sum((g.to_local().float().pow(2).sum() for g in split), torch.zeros_like(square))
    torch.distributed.all_reduce(split_square, group=split[0].device_mesh.get_group())
    norm = (square + split_square).sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in whole + [g.to_local() for g in split]:
        g.mul_(scale.to(g.dtype))
    return norm


def root_params_gathered(model):
    """Collective: around `generate` on the unwrapped model, the weights the FSDP root shards.

    Unwrapping drops the root's hooks, which alone gather its own weights (embeddings, final norm, head);
    the wrapped layers inside still gather theirs. FSDP2's root keeps its weights gathered after a forward
    but not after a backward, so a generation after a training step needs them gathered too. Any other
    model needs nothing.
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if isinstance(model, FSDPModule):
        return _fsdp2_root_unsharded(model)
    if not isinstance(model, FullyShardedDataParallel):
        return contextlib.nullcontext()
    return FullyShardedDataParallel.summon_full_params(model, recurse=False, writeback=False)


@contextlib.contextmanager
def _fsdp2_root_unsharded(model):
    """The FSDP2 root's own weights gathered (its inner units gather theirs in their forward), then
    sharded again."""
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def data_shard(accelerator) -> tuple[int, int]:
    """(index, count) of this process's data-parallel group: tensor-parallel ranks share their batches,
    so they read the same rows (accelerate's prepared loaders do the same)."""
    tp = tensor_parallel_size(accelerator)
    return accelerator.process_index // tp, accelerator.num_processes // tp


def tensor_parallel_size(accelerator) -> int:
    mesh = accelerator.state.device_mesh
    return mesh["tp"].size() if mesh is not None and "tp" in mesh.mesh_dim_names else 1


def sum_over_data(accelerator, values: torch.Tensor) -> torch.Tensor:
    """Collective: `values` summed over the data-parallel groups, each batch counted once (a sum over
    every rank counts each batch once per tensor-parallel rank that computed it)."""
    total = accelerator.reduce(values, reduction="sum")
    tp = tensor_parallel_size(accelerator)
    return total if tp == 1 else total / tp if total.is_floating_point() else total // tp


def any_rank(accelerator, *flags: bool) -> list[bool]:
    """Collective: each flag comes back true on every rank when it is true on any rank."""
    values = torch.tensor([float(flag) for flag in flags], device=accelerator.device)
    return [value > 0 for value in accelerator.reduce(values, reduction="sum").tolist()]


def agreed_error(accelerator, error: str, limit: int = 4096) -> str:
    """Collective: "" when no rank has an error, else the lowest such rank's text (its first `limit` bytes of
    UTF-8) on every rank. Each rank then raises the same words, so the line is the same whichever rank the
    launcher hears first."""
    if accelerator.num_processes == 1:
        return error
    rank = torch.tensor([accelerator.process_index if error else accelerator.num_processes])
    rank = rank.to(accelerator.device)
    torch.distributed.all_reduce(rank, op=torch.distributed.ReduceOp.MIN)
    source = int(rank.item())
    if source == accelerator.num_processes:
        return ""
    data = error.encode()[:limit] if accelerator.process_index == source else b""
    values = torch.zeros(limit + 1, dtype=torch.int32)
    values[0] = len(data)
    values[1 : len(data) + 1] = torch.tensor(list(data), dtype=torch.int32)
    values = values.to(accelerator.device)
    torch.distributed.broadcast(values, src=source)
    return bytes(values[1 : int(values[0]) + 1].tolist()).decode(errors="replace")


def from_main(accelerator, value=None, problem: Exception | None = None):
    """Collective: what the main process computed, `value`, on every process (pickled between the run's own
    processes; other processes' `value` is not read), or, when the main process met `problem` instead, that
    error raised on every process: of its type (built from its words), with the same words, so the launcher
    hears one line whichever process it hears first."""
    if accelerator.num_processes == 1:
        if problem is not None:
            raise problem
        return value
    from accelerate.utils import broadcast_object_list

    box = [(type(problem), str(problem), None) if problem is not None else (None, "", value)]
    broadcast_object_list(box, from_process=0)
    kind, error, value = box[0]
    if kind is not None:
        raise problem if accelerator.is_main_process else kind(error)
    return value


def end_training(accelerator) -> None:
    """`accelerator.end_training()` but for its destroying the process group: the trackers end, the group
    stays until the process leaves (toolkit/entry.py `leave` says why it is never destroyed)."""
    for tracker in accelerator.trackers:
        tracker.finish()


def unwrap(accelerator, model):
    """`accelerator.unwrap_model(model)`, without importing DeepSpeed where the run does not use it
    (accelerate imports it to test for its engine whenever it is installed: 0.7 s in every process). The
    other wrappers (DDP, DataParallel, FSDP1) are peeled as accelerate peels them, and a compiled model
    stays the compiled one, around the unwrapped model."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return accelerator.unwrap_model(model)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn import DataParallel
    from torch.nn.parallel import DistributedDataParallel

    compiled = None
    if is_compiled_module(model):
        compiled, model = model, model._orig_mod
    elif has_compiled_regions(model) and "_orig_mod" in model.__dict__:
        compiled, model = model, model.__dict__["_orig_mod"]
    while isinstance(model, (DistributedDataParallel, DataParallel, FullyShardedDataParallel)):
        model = model.module
    if compiled is None:
        return model
    compiled._orig_mod = model
    return compiled
