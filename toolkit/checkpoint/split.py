"""Checkpoints of a tensor-parallel, pipelined or expert-parallel model without FSDP, which accelerate's
save_state cannot write (it saves whole tensors from rank 0, and each rank holds only its part of the split
weights or its stages' layers).

They are written in the layout FSDP checkpoints already have (portable.py's `dcp`): the model and the
optimizer through torch.distributed.checkpoint, every rank writing its part and whole tensors once, keyed by
parameter name; accelerate writes the rest (scheduler, random states) as usual. So export, the portable
resume under another backend and the damage checks read them as they read FSDP checkpoints, and DCP
restores them onto the same mesh exactly.

The objects are the ones `accelerator.prepare` registered (one model, one optimizer: the recipes' shape).
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
from accelerate.checkpointing import load_accelerator_state, save_accelerator_state
from accelerate.utils import DistributedType
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from toolkit.model import expert_parallel

# The directory names accelerate gives FSDP's sharded states.
DCP_MODEL, DCP_OPTIMIZER = "pytorch_model_fsdp_0", "optimizer_0"


def is_split(accelerator) -> bool:
    """Whether this run's model is split across processes with no FSDP around it: by tensor parallelism,
    into pipeline stages (whose processes accelerate's mesh holds as its `tp` dimension), or by expert
    parallelism (its experts DTensors under DDP)."""
    mesh = accelerator.state.device_mesh
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    if mesh is not None and "tp" in mesh.mesh_dim_names and not fsdp:
        return True
    return not fsdp and any(expert_parallel.split_size(model) > 1 for model in accelerator._models[:1])


def save_split_state(accelerator, output_dir: str) -> None:
    """Collective: what `accelerator.save_state(output_dir)` saves, for a split model."""
    model, optimizer = _registered(accelerator)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(Path(output_dir) / DCP_MODEL))
    optimizer_state = get_optimizer_state_dict(model, optimizer)
    dcp.save({"optimizer": optimizer_state}, checkpoint_id=str(Path(output_dir) / DCP_OPTIMIZER))
    save_accelerator_state(
        output_dir,
        [],
        [],
        accelerator._schedulers,
        accelerator._dataloaders,
        accelerator.process_index,
        accelerator.step,
        accelerator.scaler,
    )


def load_split_state(accelerator, input_dir: str) -> None:
    """Collective: what `accelerator.load_state(input_dir)` restores, for a split model."""
    model, optimizer = _registered(accelerator)
    model_state = {"model": get_model_state_dict(model)}
    dcp.load(model_state, checkpoint_id=str(Path(input_dir) / DCP_MODEL))
    set_model_state_dict(model, model_state["model"])
    optimizer_state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(optimizer_state, checkpoint_id=str(Path(input_dir) / DCP_OPTIMIZER))
    set_optimizer_state_dict(model, optimizer, optimizer_state["optimizer"])
    found = load_accelerator_state(
        input_dir,
        [],
        [],
        accelerator._schedulers,
        accelerator._dataloaders,
        accelerator.process_index,
        accelerator.scaler,
    )
    accelerator.step = found.get("step", accelerator.step)


def _registered(accelerator):
    """The trained model and its optimizer (a separate reference model is registered after them)."""
    model, optimizer = accelerator._models[0], accelerator._optimizers[0]
    return model, getattr(optimizer, "optimizer", optimizer)
