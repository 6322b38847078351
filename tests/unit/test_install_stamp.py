"""`make install` and `make install-vllm` rebuild their environment exactly when what it was built from
changed in content: never for a file a git checkout only wrote again (a newer time, the same bytes). make,
the Makefile and the files it reads are the project's own, in a copy; each environment's python is a
stand-in that logs the pip calls it gets (a real install takes minutes)."""

import os
import shutil
import subprocess

import pytest
from helpers import REPO

INPUTS = ["Makefile", "pyproject.toml", "constraints.txt", "constraints-vllm.txt"]
# An outer make (`make test-unit`) must not pass its flags (-n, -j's job server) to the one under test.
OUTER_MAKE = {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"}


@pytest.fixture
def checkout(tmp_path):
    for name in INPUTS:
        shutil.copy(REPO / name, tmp_path / name)
    for venv in (".venv", ".venv-vllm"):
        python = tmp_path / venv / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(f'#!/bin/sh\necho "{venv} $*" >> "{tmp_path}/pip.log"\n')
        python.chmod(0o755)
    return tmp_path


def installs(checkout, target: str) -> list[str]:
    """The pip calls `make target` made, as `venv args` lines."""
    log = checkout / "pip.log"
    log.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in OUTER_MAKE}
    subprocess.run(["make", target], cwd=checkout, env=env, check=True, capture_output=True)
    return log.read_text().splitlines() if log.exists() else []


def rewritten(path):
    """What a checkout does to a file it leaves unchanged: the same bytes, written later."""
    later = path.stat().st_mtime + 60
    os.utime(path, (later, later))


@pytest.mark.parametrize(
    ("target", "venv", "inputs"),
    [
        ("install-vllm", ".venv-vllm", ["constraints-vllm.txt"]),
        ("install", ".venv", ["pyproject.toml", "constraints.txt"]),
    ],
)
def test_an_environment_is_rebuilt_when_its_inputs_change_in_content_not_in_time(
    checkout, target, venv, inputs
):
    first = installs(checkout, target)  # a fresh clone: no stamp yet
    assert first and all(line.startswith(f"{venv} -m pip install") for line in first), first
    assert installs(checkout, target) == []
    for name in inputs:
        rewritten(checkout / name)
        assert installs(checkout, target) == [], f"{name} only touched"
        with open(checkout / name, "a") as f:
            f.write("# changed\n")
        assert installs(checkout, target) == first, f"{name} changed"
        assert installs(checkout, target) == []


def test_a_removed_stamp_rebuilds(checkout):
    """`make lock` removes .venv's stamp after writing a new lock."""
    assert installs(checkout, "install")
    (checkout / ".venv" / ".installed").unlink()
    assert installs(checkout, "install")
