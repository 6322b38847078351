"""What a launch asked for: the `Launch` description every set-up and check reads, and its one-line names.

Detection (backend.py) and `ftkit check-config` (checks.py) both build a `Launch`; the set-up of each backend
family reads it, so it lives below all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.launch.deepspeed import offloads
from toolkit.launch.mesh import Mesh

ENV_SOURCE = "the accelerate launch environment"


@dataclass(frozen=True)
class Launch:
    """What the launcher asked for, read from the environment `accelerate launch` sets or from its YAML."""

    backend: str
    """single | ddp | fsdp | deepspeed | tp (tensor parallel across every process, no FSDP) | pp (pipeline
    stages, replicated by data parallel when there are more processes than stages)."""
    world_size: int
    """Processes on all machines together."""
    procs_per_node: int
    """Processes on this machine."""
    on_cpu: bool
    """No GPU here: the backend runs on gloo CPU processes (a dry run of the same command)."""
    source: str = ENV_SOURCE
    """Where the request came from, for messages (an accelerate YAML, or the launch environment)."""
    fsdp_version: int = 0
    """1 or 2 with FSDP, else 0."""
    zero_stage: int = 0
    """ZeRO stage with DeepSpeed, else 0."""
    ds_config_file: str = ""
    """DeepSpeed JSON the YAML points to ("" for accelerate-native DeepSpeed settings)."""
    ds_config: dict = field(default_factory=dict)
    """That JSON's content."""
    ds_settings: dict = field(default_factory=dict)
    """Accelerate-native DeepSpeed settings given to the launcher (YAML deepspeed_config keys), as strings."""
    launcher_precision: str = ""
    """mixed_precision given to the launcher; "" when unset (a launched process cannot tell unset from no)."""
    fsdp_settings: dict = field(default_factory=dict)
    """FSDP settings given to the launcher, keys without the fsdp_ prefix (offload_params, ...)."""
    parallel_sizes: dict = field(default_factory=dict)
    """parallelism_config sizes given to the launcher (dp_replicate, dp_shard, tp, cp, sp)."""

    @property
    def mesh(self) -> Mesh:
        """How the processes split the work: replicas, shards, tensor-parallel groups."""
        return Mesh.of(self.parallel_sizes, self.world_size, self.backend == "fsdp")

    @property
    def uses_mesh(self) -> bool:
        """A parallelism_config with a size above 1 was given (ftkit then installs accelerate's mesh)."""
        return any(size > 1 for size in self.parallel_sizes.values())


def backend_name(launch: Launch) -> str:
    fsdp = f"fsdp{launch.fsdp_version}"
    if launch.mesh.describe(fsdp):
        return launch.mesh.describe(fsdp)
    if launch.backend == "deepspeed":
        offload = offloads(launch.ds_config, launch.ds_settings)
        return f"deepspeed ZeRO-{launch.zero_stage}" + (" + offload" if offload else "")
    if launch.backend == "fsdp":
        return fsdp
    return launch.backend


def batch_split(launch: Launch) -> str:
    """`world 4`, or where tensor-parallel ranks share batches `data-parallel 2 (world 4 / tp 2)`."""
    mesh = launch.mesh
    if mesh.pp > 1:
        return f"data-parallel {mesh.data_parallel} (world {launch.world_size} / pp {mesh.pp})"
    if mesh.sp > 1:
        return f"data-parallel {mesh.data_parallel} (world {launch.world_size} / sp {mesh.sp})"
    if mesh.tp == 1:
        return f"world {launch.world_size}"
    return f"data-parallel {mesh.data_parallel} (world {launch.world_size} / tp {mesh.tp})"
