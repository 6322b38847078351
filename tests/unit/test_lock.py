"""The lock (constraints.txt) and pyproject.toml agree: every tested requirement is locked at a version its
range admits, and each floor is the release series the suite passed with, so a floor never names a
version nobody tested. `make install` installs inside the lock."""

import tomllib
from helpers import REPO
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

# Optional integrations the suite does not install; gpu's kernels need CUDA (the GPU check runs them).
UNTESTED_EXTRAS = {"trackers", "gpu"}


def locked() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not name==version"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def requirements_tested() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = [
        r
        for name, reqs in project["optional-dependencies"].items()
        if name not in UNTESTED_EXTRAS
        for r in reqs
    ]
    return [Requirement(r) for r in [*project["dependencies"], *extras]]


def test_every_tested_requirement_is_locked_inside_its_range_with_the_floor_at_the_locked_series():
    pins = locked()
    for req in requirements_tested():
        version = pins.get(canonicalize_name(req.name))
        assert version is not None, f"{req.name} is in pyproject.toml but not in constraints.txt: make lock"
        assert req.specifier.contains(version), f"constraints.txt: {req.name}=={version} is outside {req}"
        floors = [Version(s.version) for s in req.specifier if s.operator == ">="]
        assert floors, f"pyproject.toml: {req} has no floor"
        assert floors[0].release[:2] == version.release[:2], (
            f"pyproject.toml: {req}'s floor is not the tested series {version.major}.{version.minor}"
        )


def test_install_and_lock_use_the_lock():
    makefile = (REPO / "Makefile").read_text()
    # torch, its fallback, then ftkit with its extras; install-export's export extra
    assert makefile.count("install -q -c $(LOCK)") == 4
    # what .venv is rebuilt for (tests/unit/test_install_stamp.py: by content, not by time)
    assert "INSTALL_DIGEST := $(call digest,cat pyproject.toml $(LOCK);" in makefile
