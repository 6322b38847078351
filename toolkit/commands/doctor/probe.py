"""How `ftkit doctor` looks at this machine: versions, GPUs and their P2P, NCCL settings, the pairwise
all-reduce, CPU, RAM, disk, the default accelerate config, DeepSpeed's ops, bitsandbytes' backend."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from toolkit.commands.allreduce_check import check_pairs
from toolkit.commands.doctor.records import PACKAGES, Gpu, Probes
from toolkit.errors import UserError
from toolkit.launch.machine import ram_bytes
from toolkit.launch.op_builds import left_locks
from toolkit.typed_yaml import read_yaml_mapping

ALLREDUCE_TIMEOUT_S = 30
"""Per GPU pair: a healthy pair finishes in seconds, a broken P2P path makes NCCL hang forever."""


def gather_probes(
    output_dir: Path, include_warnings: bool = True, allreduce_timeout_s: float | None = None
) -> Probes:
    """Look at this machine (a few seconds; no network, nothing heavy is built). Without `include_warnings`
    the seconds-long probes that only ever warn (DeepSpeed's ops, bitsandbytes' backend: importing it takes
    about 3 s) are skipped, so `ftkit train`'s fail-level check starts the launch sooner.
    With `allreduce_timeout_s`, every GPU pair all-reduces once under that timeout (seconds per pair)."""
    import torch

    requirements = _requirements()
    packages = {name: _version(name) for name in (*PACKAGES, *requirements)}
    gpus = [_gpu(torch, i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    p2p = [
        (i, j, bool(torch.cuda.can_device_access_peer(i, j)))
        for i in range(len(gpus))
        for j in range(len(gpus))
        if i != j
    ]
    config_path = accelerate_config_path()
    return Probes(
        python=platform.python_version(),
        packages=packages,
        requirements=requirements,
        torch_cuda=torch.version.cuda,
        nccl=_nccl_version(torch) if gpus else None,
        driver=_run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], first_line=True),
        gpus=gpus,
        p2p=p2p,
        topology=_run(["nvidia-smi", "topo", "-m"]) if len(gpus) > 1 else None,
        nccl_env={k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
        cpu_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        ram_bytes=ram_bytes(),
        output_dir=str(output_dir),
        disk_free_bytes=_disk_free(output_dir),
        accelerate_config_path=str(config_path),
        accelerate_config=_read_yaml(config_path),
        deepspeed_ops=_deepspeed_ops() if packages["deepspeed"] and include_warnings else {},
        left_build_locks=[str(lock) for lock in left_locks()],
        build_tools={"ninja": shutil.which("ninja"), "c++": shutil.which("c++") or shutil.which("g++")},
        bnb_backend=_bnb_backend() if packages["bitsandbytes"] and include_warnings else None,
        allreduce=check_pairs(len(gpus), allreduce_timeout_s)
        if allreduce_timeout_s and len(gpus) > 1
        else None,
    )


def accelerate_config_path() -> Path:
    """Where `accelerate launch` looks for its default config (HF_HOME or XDG_CACHE_HOME aware)."""
    cache = os.environ.get("XDG_CACHE_HOME", str(Path("~/.cache").expanduser()))
    return (
        Path(os.environ.get("HF_HOME", os.path.join(cache, "huggingface"))).expanduser()
        / "accelerate"
        / ("default_config.yaml")
    )


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _requirements() -> dict[str, str]:
    """ftkit's required packages and their specifiers, from its installed metadata or the repo's pyproject."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        lines = [r for r in metadata.requires("ftkit") or [] if "extra ==" not in r]
    except metadata.PackageNotFoundError:
        lines = _pyproject_dependencies()
    return {req.name: str(req.specifier) for req in map(Requirement, lines)}


def _pyproject_dependencies() -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10 has no tomllib; the version check is then skipped
        return []
    pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
    if not pyproject.is_file():
        return []
    return tomllib.loads(pyproject.read_text()).get("project", {}).get("dependencies", [])


def _gpu(torch, index: int) -> Gpu:
    props = torch.cuda.get_device_properties(index)
    return Gpu(props.name, props.total_memory)


def _nccl_version(torch) -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _run(command: list[str], first_line: bool = False) -> str | None:
    if shutil.which(command[0]) is None:
        return None
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = result.stdout.strip()
    if result.returncode != 0 or not out:
        return None
    return out.splitlines()[0].strip() if first_line else out


def _disk_free(path: Path) -> int:
    existing = Path(path).resolve()
    while not existing.exists():
        existing = existing.parent
    return shutil.disk_usage(existing).free


def _read_yaml(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return read_yaml_mapping(path, "accelerate config")
    except (OSError, UserError) as exc:
        return {"error": str(exc).splitlines()[0].removeprefix(f"{path}: ")}


# Run in a child process: importing DeepSpeed logs to stderr and probes the accelerator.
_DS_PROBE = """
import json
from deepspeed.accelerator import get_accelerator
ops = {}
for op, builder in (("cpu_adam", "CPUAdamBuilder"), ("fused_adam", "FusedAdamBuilder")):
    b = get_accelerator().create_op_builder(builder)
    ops[op] = bool(b is not None and b.is_compatible(verbose=False))
print(json.dumps(ops))
"""


def _deepspeed_ops() -> dict[str, bool]:
    try:
        result = subprocess.run(
            [sys.executable, "-c", _DS_PROBE], capture_output=True, text=True, timeout=120
        )
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError):
        return {"import": False}


def _bnb_backend() -> str:
    """What bitsandbytes' import decided: the device its 4-bit layers run on, and whether its compiled
    library loaded (without it, CPU 4-bit falls back to slower torch code)."""
    from bitsandbytes import cextension, functional

    native = not isinstance(cextension.lib, cextension.ErrorHandlerMockBNBNativeLibrary)
    backend = f"{cextension.BNB_BACKEND}, native library {'loaded' if native else 'missing'}"
    if cextension.BNB_BACKEND == "CPU":
        backend += f", AVX512-BF16 {'yes' if functional.has_avx512bf16() else 'no'}"
    return backend
