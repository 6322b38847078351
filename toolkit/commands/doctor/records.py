"""What `ftkit doctor` passes around as plain data: what it saw of a machine, and what it found."""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.commands.allreduce_check import PairResult

PACKAGES = (
    "torch",
    "accelerate",
    "transformers",
    "peft",
    "datasets",
    "deepspeed",
    "bitsandbytes",
    "matplotlib",
    # The recurrent layers' GPU kernels (toolkit/model/families.py).
    "flash-linear-attention",
    "causal-conv1d",
    "mamba-ssm",
)


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int


@dataclass
class Probes:
    """Everything `diagnose` needs to know about a machine."""

    python: str
    packages: dict[str, str | None]
    """Installed version of each package in PACKAGES (None: not installed)."""
    requirements: dict[str, str]
    """ftkit's own version specifiers for its required packages, e.g. {"torch": ">=2.4"}."""
    torch_cuda: str | None
    """CUDA version torch was built with (None: a CPU build)."""
    nccl: str | None
    driver: str | None
    """NVIDIA driver version from nvidia-smi (None: no driver or no nvidia-smi)."""
    gpus: list[Gpu]
    p2p: list[tuple[int, int, bool]]
    """(i, j, whether GPU i can access GPU j's memory directly) for every ordered pair."""
    topology: str | None
    """`nvidia-smi topo -m` output."""
    nccl_env: dict[str, str]
    cpu_cores: int
    ram_bytes: int
    output_dir: str
    disk_free_bytes: int
    accelerate_config_path: str
    accelerate_config: dict | None
    """The default accelerate config's content (None: no file; {"error": ...}: unreadable)."""
    deepspeed_ops: dict[str, bool] = field(default_factory=dict)
    """Op name -> can be built (or is prebuilt) here; empty without DeepSpeed."""
    build_tools: dict[str, str | None] = field(default_factory=dict)
    """ninja and a C++ compiler, which DeepSpeed needs to build ops just in time."""
    allreduce: list[PairResult] | None = None
    """A short NCCL all-reduce on every GPU pair (None: not run)."""
    left_build_locks: list[str] = field(default_factory=list)
    """Compiled-op build locks left by builds that were cut off (toolkit/launch/op_builds.py)."""
    bnb_backend: str | None = None
    """The device bitsandbytes runs 4-bit layers on (CUDA, ROCm, XPU, CPU) and its native library's state;
    None without bitsandbytes."""


@dataclass(frozen=True)
class Finding:
    check: str
    status: str
    """ok | warn | fail."""
    message: str
    fix: str = ""
