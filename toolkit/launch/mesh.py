"""The one place the process mesh's sizes are derived: how many processes replicate, shard or split the
model, and from that how many different batches a step sees (the data-parallel size).

Processes are laid out as accelerate lays them out (dp_replicate, dp_shard, tp; tp innermost): the ranks
of one tensor-parallel group are neighbours and share a batch, every other split sees its own batches. The
processes of one pipeline (pp, from the recipe's pipeline.size) are neighbours too and share their batches.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import UserError


@dataclass(frozen=True)
class Mesh:
    """Sizes of accelerate's parallelism_config dimensions for one launch (1 where unused)."""

    dp_replicate: int = 1
    """Full replicas (HSDP: each holds the shards of one FSDP group)."""
    dp_shard: int = 1
    """Processes FSDP shards parameters, gradients and optimizer states across."""
    tp: int = 1
    """Processes each decoder layer's linear weights are split across (Megatron-style tensor parallel)."""
    pp: int = 1
    """Processes one pipeline spans, each holding consecutive decoder layers (pipeline parallel)."""
    sp: int = 1
    """Processes each sequence is split across (Ulysses sequence parallel, under DeepSpeed): they train on
    the same rows at once, each on a slice of every sequence (see toolkit/train/sequence_parallel.py)."""

    @classmethod
    def of(cls, sizes: dict[str, int], world_size: int, fsdp: bool) -> Mesh:
        """The mesh a launch asks for; without a parallelism_config, FSDP shards and DDP replicates
        across every process."""
        if not any(size > 1 for size in sizes.values()):
            return cls(dp_shard=world_size) if fsdp else cls(dp_replicate=world_size)
        return cls(
            sizes.get("dp_replicate", 1),
            sizes.get("dp_shard", 1),
            sizes.get("tp", 1),
            sizes.get("pp", 1),
            sizes.get("sp", 1),
        )

    @property
    def data_parallel(self) -> int:
        """Processes that see different batches; tensor-parallel, pipeline and sequence-parallel ranks share
        theirs."""
        return self.dp_replicate * self.dp_shard

    @property
    def size(self) -> int:
        return self.data_parallel * self.tp * self.pp * self.sp

    def data_rank(self, process_index: int) -> int:
        """Which of the data-parallel batches process `process_index` trains on."""
        return process_index // (self.tp * self.pp)

    def describe(self, fsdp_name: str) -> str:
        """e.g. `tp 2`, `fsdp2 2 x tp 2`, `hsdp 2 x 2`, `pp 2 x ddp 2`; "" where the backend's own name says
        it all."""
        if self.pp > 1:
            return f"pp {self.pp}" + (f" x ddp {self.dp_replicate}" if self.dp_replicate > 1 else "")
        if self.sp > 1:
            return f"sp {self.sp}" + (f" x dp {self.data_parallel}" if self.data_parallel > 1 else "")
        if self.tp > 1:
            parts = [str(n) for n in (self.dp_replicate, self.dp_shard) if n > 1]
            sharded = f"{fsdp_name} {' x '.join(parts)} x " if parts else ""
            return f"{sharded}tp {self.tp}"
        if self.dp_replicate > 1 and self.dp_shard > 1:
            return f"hsdp {self.dp_replicate} x {self.dp_shard}"
        return ""


def check_mesh(mesh: Mesh, world_size: int, fsdp_version: int, backend: str, where: str) -> None:
    """Refuse parallelism_config sizes this launch cannot train with, in one line naming them."""
    if mesh.size != world_size:
        raise UserError(
            f"{where}: parallelism_config sizes dp_replicate {mesh.dp_replicate} x dp_shard "
            f"{mesh.dp_shard} x tp {mesh.tp} x sp {mesh.sp} = {mesh.size}, but {world_size} processes are "
            f"launched: make them multiply to {world_size}"
        )
    if mesh.sp > 1 and backend != "deepspeed":
        raise UserError(
            f"{where}: parallelism_config_sp_size {mesh.sp} needs distributed_type: DEEPSPEED (sequence "
            "parallelism runs DeepSpeed's Ulysses attention): use accelerate_configs/sp.yaml"
        )
    if mesh.sp > 1 and mesh.tp > 1:
        raise UserError(f"{where}: parallelism_config_sp_size {mesh.sp} with tp_size {mesh.tp} is refused")
    if backend == "deepspeed" and mesh.tp > 1:
        raise UserError(
            f"{where}: parallelism_config_tp_size {mesh.tp} under DeepSpeed is refused: use "
            "accelerate_configs/tp.yaml or fsdp_tp.yaml"
        )
    if backend == "fsdp" and fsdp_version != 2:
        raise UserError(f"{where}: parallelism_config needs fsdp_version: 2 (FSDP1 has no device mesh)")
    if backend == "ddp" and mesh.tp > 1 and mesh.data_parallel > 1:
        raise UserError(
            f"{where}: parallelism_config with {mesh.data_parallel} data-parallel groups needs "
            "distributed_type: FSDP (fsdp_version: 2) to keep their gradients in sync; under "
            f"{backend} only tp may be set, to the process count"
        )
