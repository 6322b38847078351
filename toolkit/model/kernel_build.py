"""`make install-gpu-kernels`: causal-conv1d and mamba-ssm, the GPU kernels of the short-convolution and
Mamba-2 layers (toolkit/model/families.py), compiled against the environment's CUDA torch. They are not in
the `gpu` extra because pip cannot build them in isolation (their build imports torch) and they compile
CUDA code for minutes (their setup first looks for a prebuilt wheel matching torch and CUDA on the
projects' release pages, and compiles where none matches); without them those layers run transformers'
PyTorch versions and packed rows run them one example at a time (exact, slower).

What would make the build fail is refused first, in one line, exit 2: no nvcc, a CPU build of torch, or an
nvcc whose CUDA major release is not torch's. Each package then builds with a line every PROGRESS_S seconds
and its time at the end, inside the versions the suite passed with (constraints.txt: pip may not move torch
or transformers); pip's output goes to a log file beside the environment, shown in part on failure.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import torch

from toolkit.model.families import CAUSAL_CONV, MAMBA_SSM

# In build order: mamba-ssm's build uses causal-conv1d.
PACKAGES = (f"{CAUSAL_CONV}>=1.5", f"{MAMBA_SSM}>=2.2")
PROGRESS_S = 30
PIP = (sys.executable, "-m", "pip", "install", "--no-build-isolation")


class Refused(Exception):
    """What stops the build before it starts, in one line."""


def nvcc_release() -> str:
    """The CUDA release of the nvcc a build would use (CUDA_HOME's, else the one on PATH)."""
    home = os.environ.get("CUDA_HOME")
    nvcc = str(Path(home) / "bin" / "nvcc") if home else shutil.which("nvcc")
    if not nvcc or not Path(nvcc).exists():
        raise Refused(
            "no nvcc (the CUDA toolkit) on this machine: causal-conv1d and mamba-ssm compile CUDA code; "
            "install the toolkit of torch's CUDA release or set CUDA_HOME"
        )
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    found = re.search(r"release (\d+\.\d+)", out)
    if found is None:
        raise Refused(f"{nvcc} --version names no CUDA release")
    return found.group(1)


def check(torch_version: str, torch_cuda: str | None, nvcc: str) -> None:
    """Refuse a CPU torch, or an nvcc of another CUDA major release than torch's."""
    if torch_cuda is None:
        raise Refused(
            f"torch {torch_version} is a CPU build: the kernels are built against a CUDA torch "
            "(make install on a machine with nvidia-smi installs one)"
        )
    if nvcc.split(".")[0] != torch_cuda.split(".")[0]:
        raise Refused(
            f"nvcc is CUDA {nvcc} and torch {torch_version} is built for CUDA {torch_cuda}: the build needs "
            "the same major release (set CUDA_HOME to that toolkit)"
        )


def build(spec: str, log: Path, constraints: Path | None = None, progress_s: float = PROGRESS_S) -> int:
    """pip-install `spec` (within `constraints`), a line every `progress_s` seconds and its time at the end;
    pip's exit code."""
    name = _name(spec)
    print(f"{name}: building (compiles CUDA code; pip's output in {log})", flush=True)
    start, next_line = time.monotonic(), progress_s
    env = {**os.environ, "MAX_JOBS": os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))}
    with log.open("w") as out:
        within = ["-c", str(constraints)] if constraints else []
        pip = subprocess.Popen([*PIP, *within, spec], stdout=out, stderr=subprocess.STDOUT, env=env)
        while pip.poll() is None:
            time.sleep(min(1.0, progress_s))
            elapsed = time.monotonic() - start
            if elapsed >= next_line:
                print(f"{name}: still building, {elapsed:.0f} s", flush=True)
                next_line += progress_s
    took = time.monotonic() - start
    if pip.returncode:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        print("\n".join(tail), file=sys.stderr)
        print(
            f"{name}: pip failed (exit {pip.returncode}) after {took:.0f} s; all of it in {log}",
            file=sys.stderr,
        )
        return pip.returncode
    print(f"{name}: built and installed in {took:.0f} s", flush=True)
    return 0


def main(logs: Path, constraints: Path | None = None) -> int:
    """Build what is missing; 2 where the build is refused, pip's exit code where it fails."""
    found = _installed()
    missing = [spec for spec in PACKAGES if _name(spec) not in found]
    for name, version in found.items():
        print(f"{name}: {version} already installed")
    if not missing:
        return 0
    try:
        check(torch.__version__, torch.version.cuda, nvcc_release())
    except Refused as refused:
        print(f"make install-gpu-kernels: {refused}", file=sys.stderr)
        return 2
    logs.mkdir(parents=True, exist_ok=True)
    for spec in missing:
        code = build(spec, logs / f"{_name(spec)}.log", constraints)
        if code:
            return code
    return 0


def _name(spec: str) -> str:
    return re.split(r"[<>=]", spec)[0]


def _installed() -> dict[str, str]:
    """The kernel packages installed, by name, with their versions."""
    found = {}
    for spec in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[_name(spec)] = metadata.version(_name(spec))
    return found


if __name__ == "__main__":
    args = [Path(arg) for arg in sys.argv[1:3]]
    sys.exit(main(args[0] if args else Path(sys.prefix) / "kernel-builds", *args[1:]))
