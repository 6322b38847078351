"""`make install-gpu-kernels` (toolkit/model/kernel_build.py): refused in one line, exit 2, where the build
cannot work (no nvcc, a CPU torch, an nvcc of another CUDA major release); a build prints its progress and
its time, and a failed one pip's last lines. pip itself is replaced by a short script here: nothing is
compiled or installed."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import REPO

from toolkit.model import kernel_build

NO_KERNELS = {}


@pytest.fixture
def nothing_installed(monkeypatch):
    monkeypatch.setattr(kernel_build, "_installed", lambda: dict(NO_KERNELS))


def test_without_nvcc_it_is_one_line(monkeypatch, tmp_path, capsys, nothing_installed):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr(kernel_build.shutil, "which", lambda name: None)
    assert kernel_build.main(tmp_path) == 2
    err = capsys.readouterr().err
    assert err.startswith("make install-gpu-kernels: no nvcc (the CUDA toolkit) on this machine") and (
        err.count("\n") == 1
    )
    assert not list(tmp_path.iterdir())


def test_a_cpu_torch_or_another_cuda_release_is_refused():
    with pytest.raises(kernel_build.Refused, match=r"^torch 2.13.0\+cpu is a CPU build"):
        kernel_build.check("2.13.0+cpu", None, "13.0")
    with pytest.raises(
        kernel_build.Refused, match=r"^nvcc is CUDA 13.0 and torch 2.13.0 is built for CUDA 12.8"
    ):
        kernel_build.check("2.13.0", "12.8", "13.0")
    kernel_build.check("2.13.0", "12.8", "12.9")


def test_on_this_cpu_machine_the_module_refuses_in_one_line(tmp_path):
    """As make runs it, on a CPU torch (with or without nvcc): exit 2, one line, nothing built."""
    run = subprocess.run(
        [sys.executable, "-m", "toolkit.model.kernel_build", str(tmp_path / "logs")],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 2 and run.stdout == "", run.stderr
    assert run.stderr.startswith("make install-gpu-kernels: ") and run.stderr.count("\n") == 1
    assert not (tmp_path / "logs").exists()


def fake_pip(monkeypatch, code: int, seconds: float):
    """pip replaced by a script that prints its arguments, waits, and exits with `code`."""
    script = (
        f"import sys, time; print('compiling', sys.argv[1:]); time.sleep({seconds}); print('last line'); "
        f"sys.exit({code})"
    )
    monkeypatch.setattr(kernel_build, "PIP", (sys.executable, "-c", script))
    monkeypatch.setattr(kernel_build, "nvcc_release", lambda: "12.8")
    monkeypatch.setattr(kernel_build, "check", lambda *args: None)


def test_a_build_shows_progress_and_its_time(monkeypatch, tmp_path, capsys, nothing_installed):
    fake_pip(monkeypatch, 0, 1.5)
    log, constraints = tmp_path / "c.log", REPO / "constraints.txt"
    assert kernel_build.build("causal-conv1d>=1.5", log, constraints, progress_s=0.5) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"causal-conv1d: building (compiles CUDA code; pip's output in {log})"
    assert [line for line in out if line.startswith("causal-conv1d: still building, ")]
    assert out[-1].startswith("causal-conv1d: built and installed in ") and out[-1].endswith(" s")
    assert f"compiling ['-c', '{constraints}', 'causal-conv1d>=1.5']" in log.read_text()


def test_every_missing_package_is_built_in_order_and_a_failure_stops(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(kernel_build, "_installed", lambda: {"causal-conv1d": "1.7.0"})
    fake_pip(monkeypatch, 0, 0)
    assert kernel_build.main(tmp_path) == 0
    out = capsys.readouterr().out
    assert out.startswith("causal-conv1d: 1.7.0 already installed\nmamba-ssm: building")
    fake_pip(monkeypatch, 3, 0)
    assert kernel_build.main(tmp_path) == 3
    err = capsys.readouterr().err
    assert "last line" in err and "mamba-ssm: pip failed (exit 3) after " in err


def test_make_runs_it_after_install_within_the_lock():
    makefile = (REPO / "Makefile").read_text()
    target = (
        "install-gpu-kernels: install\n\t$(PY) -m toolkit.model.kernel_build $(VENV)/kernel-builds $(LOCK)\n"
    )
    assert target in makefile
