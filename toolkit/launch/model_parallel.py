"""Model-parallel launches (tensor parallel, FSDP x TP, HSDP, pipeline): accelerate's device mesh, installed
once the state has its final type, and the plain state a tensor-parallel-only launch runs on."""

from __future__ import annotations

from accelerate.state import PartialState
from accelerate.utils import DistributedType, ParallelismConfig

from toolkit.launch.mesh import Mesh


def without_fsdp(state) -> None:
    """Plain multi-process state for a model split across every process (the FSDP launch it came from
    has nothing to shard); on gloo CPU processes accelerate never switched FSDP on."""
    if state.distributed_type != DistributedType.FSDP:
        return
    state.fsdp_plugin = None
    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def install_mesh(accelerator, mesh: Mesh) -> None:
    """Give accelerate the launch's device mesh, now that the state has its final type.

    A pipeline's processes are given as its `tp` dimension: like tensor-parallel ranks they share their
    batches (accelerate's loaders then shard by replica) and take no DDP wrapper (toolkit/pipeline
    averages each stage's gradients over the replicas, accelerate's `dp_shard` dimension).

    accelerate's own check of the mesh runs for FSDP2. It refuses a tensor-parallel-only launch on CPU
    processes (MULTI_CPU), although that trains exactly (accelerate puts no DDP wrapper around a split
    model); `checks.check_launch` has checked its sizes.

    Under FSDP x TP accelerate is told of the data-parallel dimensions only: its tensor-parallel preparation
    (1.15) imports a transformers class that transformers 5 no longer has, and ftkit has split the model
    itself. FSDP shards over the data-parallel dimensions of the whole mesh, and the loaders read the whole
    mesh, so tensor-parallel ranks still share their batches."""
    if mesh.pp > 1:
        # accelerate takes tp only with a dp_shard dimension; nothing is sharded, it names the replicas.
        config = ParallelismConfig(dp_replicate_size=1, dp_shard_size=mesh.data_parallel, tp_size=mesh.pp)
    else:
        config = ParallelismConfig(
            dp_replicate_size=mesh.dp_replicate, dp_shard_size=mesh.dp_shard, tp_size=mesh.tp
        )
    state = accelerator.state
    state.parallelism_config = config
    state.device_mesh = config.get_device_mesh(accelerator.device.type)
    if state.distributed_type == DistributedType.FSDP:
        config._validate_accelerator(accelerator)
        if mesh.tp > 1:
            state.parallelism_config = ParallelismConfig(
                dp_replicate_size=mesh.dp_replicate, dp_shard_size=mesh.dp_shard, tp_size=1
            )
