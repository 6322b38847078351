"""`ftkit doctor`: is this machine ready to train? Versions, GPUs, P2P, NCCL settings and a pairwise
all-reduce, CPU, RAM, disk.

`gather_probes` is the only function that looks at the machine; `diagnose` turns its `Probes` into findings,
so a test can describe any machine (two RTX 4090s without P2P, mismatched GPUs, little RAM) as plain data.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.commands.allreduce_check import PairResult, check_pairs
from toolkit.errors import UserError
from toolkit.launch.machine import GEFORCE_40, GIB, ram_bytes
from toolkit.typed_yaml import read_yaml_mapping

PACKAGES = (
    "torch",
    "accelerate",
    "transformers",
    "peft",
    "datasets",
    "deepspeed",
    "bitsandbytes",
    "matplotlib",
)
OPTIONAL = {
    "deepspeed": "the zero*.yaml configs need it: pip install 'ftkit[deepspeed]'",
    "bitsandbytes": "model.method qlora needs it: pip install 'ftkit[qlora]'",
    "matplotlib": "ftkit plot needs it: pip install 'ftkit[plot]'",
}
MIN_CORES_PER_GPU, GOOD_CORES_PER_GPU = 2, 4
MIN_RAM_PER_GPU = 16 * GIB
MIN_DISK, GOOD_DISK = 5 * GIB, 50 * GIB
ALLREDUCE_TIMEOUT_S = 30
"""Per GPU pair: a healthy pair finishes in seconds, a broken P2P path makes NCCL hang forever."""
DRY_RUN = "accelerate launch --config_file accelerate_configs/<x>.yaml recipes/finetune_llm.py"


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
    bnb_backend: str | None = None
    """The device bitsandbytes runs 4-bit layers on (CUDA, ROCm, XPU, CPU) and its native library's state;
    None without bitsandbytes."""
    """A short NCCL all-reduce on every GPU pair (None: not run)."""


@dataclass(frozen=True)
class Finding:
    check: str
    status: str
    """ok | warn | fail."""
    message: str
    fix: str = ""


def gather_probes(
    output_dir: Path, deepspeed_ops: bool = True, allreduce_timeout_s: float | None = None
) -> Probes:
    """Look at this machine (a few seconds; no network, nothing heavy is built). Without `deepspeed_ops`
    the seconds-long op probe is skipped: it only ever warns, so `ftkit train`'s fail-level check skips it.
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
        deepspeed_ops=_deepspeed_ops() if packages["deepspeed"] and deepspeed_ops else {},
        build_tools={"ninja": shutil.which("ninja"), "c++": shutil.which("c++") or shutil.which("g++")},
        bnb_backend=_bnb_backend() if packages["bitsandbytes"] else None,
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
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
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


def diagnose(p: Probes) -> list[Finding]:
    """Every check, in the order a person would fix them."""
    findings = [
        _versions(p),
        *_requirements_met(p),
        *_optional_packages(p),
        _cuda_stack(p),
        *_gpu_findings(p),
        _p2p(p),
        _nccl_env(p),
        _allreduce(p),
        _cpu(p),
        _ram(p),
        _disk(p),
        _accelerate_default(p),
        _deepspeed(p),
        _bitsandbytes(p),
    ]
    return [f for f in findings if f is not None]


def exit_code(findings: list[Finding]) -> int:
    return 1 if any(f.status == "fail" for f in findings) else 0


def _versions(p: Probes) -> Finding:
    shown = [f"python {p.python}"]
    for name in PACKAGES:
        version = p.packages.get(name)
        if version and name == "torch":
            version += f" (CUDA {p.torch_cuda})" if p.torch_cuda else " (CPU build)"
        if version:
            shown.append(f"{name} {version}")
    if tuple(int(x) for x in p.python.split(".")[:2]) < (3, 10):
        return Finding("versions", "fail", ", ".join(shown), "ftkit needs Python >= 3.10")
    return Finding("versions", "ok", ", ".join(shown))


def _requirements_met(p: Probes) -> list[Finding]:
    from packaging.specifiers import SpecifierSet

    findings = []
    for name, spec in p.requirements.items():
        version = p.packages.get(name)
        if version is None:
            findings.append(Finding(name, "fail", f"{name} is not installed", f"pip install '{name}{spec}'"))
        elif spec and not SpecifierSet(spec).contains(version, prereleases=True):
            findings.append(
                Finding(
                    name, "fail", f"{name} {version} does not satisfy {spec}", f"pip install '{name}{spec}'"
                )
            )
    return findings


def _optional_packages(p: Probes) -> list[Finding]:
    return [
        Finding(name, "warn", f"{name} is not installed", OPTIONAL[name])
        for name in OPTIONAL
        if p.packages.get(name) is None
    ]


def _bnb_backend() -> str:
    """What bitsandbytes' import decided: the device its 4-bit layers run on, and whether its compiled
    library loaded (without it, CPU 4-bit falls back to slower torch code)."""
    from bitsandbytes import cextension, functional

    native = not isinstance(cextension.lib, cextension.ErrorHandlerMockBNBNativeLibrary)
    backend = f"{cextension.BNB_BACKEND}, native library {'loaded' if native else 'missing'}"
    if cextension.BNB_BACKEND == "CPU":
        backend += f", AVX512-BF16 {'yes' if functional.has_avx512bf16() else 'no'}"
    return backend


def _bitsandbytes(p: Probes) -> Finding | None:
    if p.bnb_backend is None:
        return None
    status = "warn" if "missing" in p.bnb_backend and not p.bnb_backend.startswith("CPU") else "ok"
    fix = "" if status == "ok" else "reinstall bitsandbytes for this torch build: pip install 'ftkit[qlora]'"
    return Finding("bitsandbytes", status, f"bitsandbytes 4-bit backend: {p.bnb_backend}", fix)


def _cuda_stack(p: Probes) -> Finding | None:
    if p.gpus:
        return Finding(
            "cuda",
            "ok",
            f"CUDA {p.torch_cuda} (torch build), NCCL {p.nccl or 'unknown'}, "
            f"driver {p.driver or 'unknown (no nvidia-smi)'}",
        )
    if p.driver is None:
        return None
    if p.torch_cuda is None:
        return Finding(
            "cuda",
            "fail",
            f"NVIDIA driver {p.driver} found but torch is a CPU build",
            "install a CUDA build of torch for this driver (see pytorch.org/get-started)",
        )
    return Finding(
        "cuda",
        "fail",
        f"NVIDIA driver {p.driver} and CUDA {p.torch_cuda} torch, but torch sees no GPU",
        "check CUDA_VISIBLE_DEVICES and that the driver supports this CUDA version (nvidia-smi)",
    )


def _gpu_findings(p: Probes) -> list[Finding]:
    if not p.gpus:
        return [
            Finding(
                "gpus",
                "warn",
                f"no GPU: CPU only, so every accelerate config runs as a CPU dry run on "
                f"gloo processes ({DRY_RUN})",
                "fine for a dry run; train for real on NVIDIA GPUs (ftkit plan says which fit)",
            )
        ]
    kinds = {(g.name, g.memory_bytes) for g in p.gpus}
    listing = ", ".join(f"{i}: {g.name} ({g.memory_bytes / GIB:.1f} GiB)" for i, g in enumerate(p.gpus))
    if len(kinds) == 1:
        return [
            Finding(
                "gpus",
                "ok",
                f"{len(p.gpus)} x {p.gpus[0].name} ({p.gpus[0].memory_bytes / GIB:.1f} GiB), identical",
            )
        ]
    return [
        Finding(
            "gpus",
            "warn",
            f"mismatched GPUs: {listing}",
            "the smallest GPU bounds every rank's memory and the slowest paces every step: "
            "CUDA_VISIBLE_DEVICES=<identical ones>",
        )
    ]


def _p2p(p: Probes) -> Finding | None:
    if len(p.gpus) < 2:
        return None
    claimed = [(i, j) for i, j, ok in p.p2p if ok]
    missing = sorted({tuple(sorted((i, j))) for i, j, ok in p.p2p if not ok})
    if any(GEFORCE_40.search(g.name) for g in p.gpus):
        return _geforce_40_p2p(p, bool(claimed))
    if not missing:
        nvlink = bool(p.topology and re.search(r"\bNV\d+\b", p.topology))
        return Finding("p2p", "ok", "P2P between every GPU pair" + (", NVLink" if nvlink else " (PCIe)"))
    pairs = ", ".join(f"{i}-{j}" for i, j in missing)
    return Finding(
        "p2p",
        "warn",
        f"no P2P between GPUs {pairs}: NCCL copies through host memory, slowing every "
        "all-reduce (ZeRO-3 and FSDP most)",
        "expected on consumer cards: prefer ddp or zero2 (ftkit plan), or rent NVLink machines",
    )


def _geforce_40_p2p(p: Probes, driver_claims_p2p: bool) -> Finding:
    fix = "export NCCL_P2P_DISABLE=1 NCCL_IB_DISABLE=1"
    if p.nccl_env.get("NCCL_P2P_DISABLE") != "1":
        if driver_claims_p2p:
            return Finding(
                "p2p",
                "fail",
                "GeForce RTX 40xx has no P2P, but the driver reports P2P access and "
                "NCCL_P2P_DISABLE is not set: NCCL would use it and hang",
                fix,
            )
        return Finding("p2p", "warn", "GeForce RTX 40xx has no P2P and NCCL_P2P_DISABLE is not set", fix)
    if p.nccl_env.get("NCCL_IB_DISABLE") != "1":
        return Finding(
            "p2p", "warn", "GeForce RTX 40xx: NCCL_P2P_DISABLE=1 is set but NCCL_IB_DISABLE is not", fix
        )
    return Finding(
        "p2p",
        "ok",
        "GeForce RTX 40xx without P2P: NCCL_P2P_DISABLE=1 and NCCL_IB_DISABLE=1 are set "
        "(NCCL goes through host memory)",
    )


def _nccl_env(p: Probes) -> Finding:
    shown = " ".join(f"{k}={v}" for k, v in p.nccl_env.items()) or "none set"
    geforce_40 = any(GEFORCE_40.search(g.name) for g in p.gpus)
    full_p2p = len(p.gpus) > 1 and all(ok for _, _, ok in p.p2p)
    if p.nccl_env.get("NCCL_P2P_DISABLE") == "1" and full_p2p and not geforce_40:
        return Finding(
            "nccl env",
            "warn",
            f"{shown}: P2P disabled although every GPU pair supports it",
            "unset NCCL_P2P_DISABLE for faster all-reduce",
        )
    return Finding("nccl env", "ok", f"NCCL variables: {shown}")


def _allreduce(p: Probes) -> Finding | None:
    if not p.allreduce or len(p.gpus) < 2:
        return None
    broken = [r for r in p.allreduce if r.status != "ok" and r.without_p2p != "ok"]
    fixed = [r for r in p.allreduce if r.status != "ok" and r.without_p2p == "ok"]
    if broken:
        first = broken[0].devices
        return Finding(
            "allreduce",
            "fail",
            f"NCCL all-reduce on GPUs {_outcomes(broken)}",
            "see where NCCL stops: NCCL_DEBUG=INFO python -m toolkit.commands.allreduce_check "
            f"--devices {first[0]},{first[1]}",
        )
    if fixed:
        return _allreduce_needs_p2p_off(p, fixed)
    slowest = max(p.allreduce, key=lambda r: r.seconds)
    return Finding(
        "allreduce",
        "ok",
        f"NCCL all-reduce passed on every GPU pair ({len(p.allreduce)}), sums checked; slowest "
        f"{_pair(slowest)} in {slowest.seconds:.1f} s with start-up",
    )


def _allreduce_needs_p2p_off(p: Probes, fixed: list[PairResult]) -> Finding:
    message = f"NCCL all-reduce on GPUs {_outcomes(fixed)}: their P2P path is broken"
    # The rule of launch.checks._disable_nccl_p2p, which every ftkit recipe process runs before NCCL starts.
    geforce_40 = any(GEFORCE_40.search(g.name) for g in p.gpus)
    if geforce_40 and not any(ok for i, j, ok in p.p2p if (i, j) == (0, 1)):
        return Finding(
            "allreduce",
            "warn",
            message,
            "ftkit's recipes set NCCL_P2P_DISABLE=1 themselves on these RTX 40xx GPUs; "
            "for other programs: export NCCL_P2P_DISABLE=1",
        )
    return Finding("allreduce", "fail", message, "export NCCL_P2P_DISABLE=1")


def _outcomes(results: list[PairResult]) -> str:
    """E.g. `0-1 hung (no result within 30 s), ok with NCCL_P2P_DISABLE=1`."""
    return "; ".join(
        f"{_pair(r)} {r.status} ({r.reason})"
        + (f", {r.without_p2p} with NCCL_P2P_DISABLE=1" if r.without_p2p else "")
        for r in results
    )


def _pair(result: PairResult) -> str:
    return f"{result.devices[0]}-{result.devices[1]}"


def _cpu(p: Probes) -> Finding:
    per_gpu = p.cpu_cores / max(1, len(p.gpus))
    message = f"{p.cpu_cores} CPU cores" + (f", {per_gpu:g} per GPU" if p.gpus else "")
    if per_gpu < MIN_CORES_PER_GPU:
        return Finding(
            "cpu",
            "warn",
            f"{message} (rule of thumb: {MIN_CORES_PER_GPU}-{GOOD_CORES_PER_GPU} per GPU)",
            "each process needs a core plus its data.num_workers: set data.num_workers: 0, "
            "or use fewer processes",
        )
    return Finding("cpu", "ok", message)


def _ram(p: Probes) -> Finding:
    per_gpu = p.ram_bytes / max(1, len(p.gpus))
    message = f"{p.ram_bytes / GIB:.1f} GiB RAM" + (f", {per_gpu / GIB:.1f} GiB per GPU" if p.gpus else "")
    if per_gpu < MIN_RAM_PER_GPU:
        return Finding(
            "ram",
            "warn",
            f"{message} (rule of thumb: >= {MIN_RAM_PER_GPU // GIB} GiB per GPU)",
            "every process loads the whole model into RAM first (ZeRO-3 excepted): use "
            "zero3.yaml, a smaller model, or a machine with more RAM (ftkit plan shows the need)",
        )
    return Finding("ram", "ok", message)


def _disk(p: Probes) -> Finding:
    message = f"{p.disk_free_bytes / GIB:.1f} GiB free at {p.output_dir}"
    fix = (
        "full fine-tune checkpoints hold weights and optimizer states: free space or pick another output_dir"
    )
    if p.disk_free_bytes < MIN_DISK:
        return Finding("disk", "fail", message, fix)
    if p.disk_free_bytes < GOOD_DISK:
        return Finding("disk", "warn", f"{message} (LoRA runs fit; full fine-tune checkpoints may not)", fix)
    return Finding("disk", "ok", message)


def _accelerate_default(p: Probes) -> Finding:
    path, config = p.accelerate_config_path, p.accelerate_config
    if config is None:
        return Finding(
            "accelerate",
            "ok",
            f"no default config at {path}: fine, ftkit's commands pass "
            "--config_file accelerate_configs/<x>.yaml",
        )
    if "error" in config:
        return Finding(
            "accelerate",
            "warn",
            f"{path} is unreadable: {config['error']}",
            "delete it, or rewrite it with `accelerate config`",
        )
    summary = ", ".join(
        f"{k} {config.get(k)}" for k in ("distributed_type", "num_processes", "mixed_precision")
    )
    processes = config.get("num_processes")
    if p.gpus and isinstance(processes, int) and processes > len(p.gpus):
        return Finding(
            "accelerate",
            "warn",
            f"{path}: {summary}, more processes than GPUs",
            "pass --config_file accelerate_configs/<x>.yaml, or fix it with `accelerate config`",
        )
    if p.gpus and config.get("use_cpu") is True:
        return Finding(
            "accelerate",
            "warn",
            f"{path}: use_cpu is true on a GPU machine",
            "pass --config_file accelerate_configs/<x>.yaml, or fix it with `accelerate config`",
        )
    return Finding("accelerate", "ok", f"default config {path}: {summary} (a --config_file overrides it)")


def _deepspeed(p: Probes) -> Finding | None:
    if not p.packages.get("deepspeed"):
        return None
    fix = "install ninja and a C++ compiler (pip install ninja; apt install build-essential)"
    if p.deepspeed_ops.get("import") is False:
        return Finding(
            "deepspeed",
            "warn",
            "deepspeed is installed but fails to import: zero*.yaml cannot run",
            "reinstall it: pip install --force-reinstall deepspeed (python -m deepspeed.env_report)",
        )
    missing = [tool for tool, where in p.build_tools.items() if where is None]
    if missing or not p.deepspeed_ops.get("cpu_adam"):
        why = f"{' and '.join(missing)} missing" if missing else "cpu_adam is not compatible here"
        return Finding(
            "deepspeed", "warn", f"DeepSpeed ops cannot build ({why}): zero3_offload needs cpu_adam", fix
        )
    fused = (
        "fused_adam ok" if p.deepspeed_ops.get("fused_adam") else "no fused_adam (not needed: torch AdamW)"
    )
    return Finding("deepspeed", "ok", f"ops build just in time (ninja, c++ found): cpu_adam ok, {fused}")


def render_text(findings: list[Finding], probes: Probes) -> str:
    """One line per finding (and its fix), the topology matrix when there is one, and a tally."""
    lines = []
    for f in findings:
        lines.append(f"{f.status:5} {f.check:11} {f.message}")
        if f.fix and f.status != "ok":
            lines.append(f"{'':17} fix: {f.fix}")
    if probes.topology:
        lines += ["", "nvidia-smi topo -m:", *(f"  {line}" for line in probes.topology.splitlines())]
    tally = {s: sum(f.status == s for f in findings) for s in ("fail", "warn", "ok")}
    lines += ["", ", ".join(f"{n} {s}" for s, n in tally.items())]
    return "\n".join(lines)


def to_json(findings: list[Finding], probes: Probes) -> dict:
    return {
        "ok": exit_code(findings) == 0,
        "findings": [dataclasses.asdict(f) for f in findings],
        "probes": dataclasses.asdict(probes),
    }
