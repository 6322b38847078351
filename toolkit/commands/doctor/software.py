"""`ftkit doctor`'s software checks: Python and package versions against ftkit's requirements, the
optional extras, the default accelerate config, DeepSpeed's ops and bitsandbytes' backend."""

from __future__ import annotations

from toolkit.commands.doctor.records import PACKAGES, Finding, Probes
from toolkit.model.families import GATED_DELTA_NET, KIMI_DELTA, MAMBA2, SHORT_CONV, install_line

OPTIONAL = {
    "deepspeed": "the zero*.yaml configs need it: pip install 'ftkit[deepspeed]'",
    "bitsandbytes": "model.method qlora needs it: pip install 'ftkit[qlora]'",
    "matplotlib": "ftkit plot needs it: pip install 'ftkit[plot]'",
}


def versions(p: Probes) -> Finding:
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


def requirements_met(p: Probes) -> list[Finding]:
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


def optional_packages(p: Probes) -> list[Finding]:
    return [
        Finding(name, "warn", f"{name} is not installed", OPTIONAL[name])
        for name in OPTIONAL
        if p.packages.get(name) is None
    ]


def recurrent_kernels(p: Probes) -> Finding | None:
    """On a GPU machine, each recurrent layer kind's kernel packages: without them transformers runs its
    PyTorch versions and ftkit runs packed rows through those layers one example at a time (exact, slower)."""
    if not p.gpus:
        return None
    kinds = (GATED_DELTA_NET, KIMI_DELTA, SHORT_CONV, MAMBA2)
    shown = "; ".join(
        f"{kind.name}: " + ", ".join(f"{name} {p.packages.get(name) or 'missing'}" for name in kind.kernels)
        for kind in kinds
    )
    missing = [
        name for name in dict.fromkeys(k for kind in kinds for k in kind.kernels) if not p.packages.get(name)
    ]
    if not missing:
        return Finding("recurrent kernels", "ok", shown)
    return Finding(
        "recurrent kernels",
        "warn",
        f"{shown} (their layers run transformers' PyTorch versions, packed rows one example at a time)",
        f"{install_line(missing)}, where those families train",
    )


def accelerate_default(p: Probes) -> Finding:
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


def deepspeed_ops(p: Probes) -> Finding | None:
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


def bitsandbytes_backend(p: Probes) -> Finding | None:
    if p.bnb_backend is None:
        return None
    status = "warn" if "missing" in p.bnb_backend and not p.bnb_backend.startswith("CPU") else "ok"
    fix = "" if status == "ok" else "reinstall bitsandbytes for this torch build: pip install 'ftkit[qlora]'"
    return Finding("bitsandbytes", status, f"bitsandbytes 4-bit backend: {p.bnb_backend}", fix)


def build_locks(p: Probes) -> Finding | None:
    """A compiled op whose build was cut off: every run that loads it hangs (toolkit/launch/op_builds.py).
    A warning here: a DeepSpeed launch's own checks refuse it, other runs may never load that op."""
    if not p.left_build_locks:
        return None
    first, more = p.left_build_locks[0], len(p.left_build_locks) - 1
    also = f" (and {more} more like it)" if more else ""
    return Finding(
        "op builds",
        "warn",
        f"{first}: left by a build that was cut off{also}; every run that loads that op waits on it for ever",
        f"remove it (no process on this machine holds it): rm {first}",
    )
