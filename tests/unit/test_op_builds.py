"""A compiled op's build lock left by a build that was cut off: found (old, held by no process), said in one
line by a DeepSpeed launch's checks, `python -m toolkit.launch.op_builds` and `ftkit doctor`; a build in
progress (held open, or young) is left alone."""

import dataclasses
import os
import time

from helpers import REPO
from test_doctor import finding, machine

from toolkit.commands.cli import main as cli
from toolkit.commands.doctor.report import exit_code
from toolkit.launch import op_builds


def lock_in(root, op: str, age_s: float):
    lock = root / "py311_cpu" / op / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_only_an_old_lock_no_process_holds_is_left_over(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    left = lock_in(tmp_path, "deepspeed_shm_comm", op_builds.LEFT_AFTER_S + 60)
    lock_in(tmp_path, "cpu_adam", 30)  # a build that started half a minute ago
    held = lock_in(tmp_path, "fused_adam", op_builds.LEFT_AFTER_S + 60)
    with open(held):  # the building process holds its lock open
        assert op_builds.left_locks() == [left]
    assert op_builds.left_locks() == [left, held]
    # Where the variable is unset, torch's per-user cache (its folder for this Python and build inside).
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert op_builds.extensions_root() == tmp_path / "cache" / "torch_extensions"
    assert op_builds.left_locks() == []
    moved = lock_in(tmp_path / "cache" / "torch_extensions", "cpu_adam", op_builds.LEFT_AFTER_S + 60)
    assert op_builds.left_locks() == [moved]


def test_a_deepspeed_launch_and_the_module_say_it_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cli(["check-config", "accelerate_configs/ddp.yaml"]) == 0
    assert cli(["check-config", "accelerate_configs/zero3.yaml"]) == 0
    capsys.readouterr()
    lock = lock_in(tmp_path, "deepspeed_shm_comm", 3600)
    said = (
        f"{lock}: a build of the compiled op 'deepspeed_shm_comm' was cut off 60 min ago and left its lock "
        "(no process on this machine holds it), so every run that loads the op waits on it for ever: "
        "remove the file"
    )
    assert cli(["check-config", "accelerate_configs/zero3.yaml"]) == 2
    assert capsys.readouterr().err.strip() == f"ftkit check-config: error: {said}"
    assert cli(["check-config", "accelerate_configs/ddp.yaml"]) == 0  # DDP loads no compiled op
    assert op_builds.main() == 2
    assert capsys.readouterr().err.strip() == said
    assert lock.exists()  # said, never removed: the user removes it


def test_doctor_names_the_lock_and_how_to_remove_it():
    lock = "/home/me/.cache/torch_extensions/py311_cpu/cpu_adam/lock"
    seen = finding(machine(left_build_locks=[lock]), "op builds")
    assert seen.status == "warn" and seen.fix == f"remove it (no process on this machine holds it): rm {lock}"
    assert "cut off; every run that loads that op waits on it for ever" in seen.message
    two = dataclasses.replace(machine(), left_build_locks=["/a/lock", "/b/lock"])
    assert "(and 1 more like it)" in finding(two, "op builds").message
    assert exit_code([finding(two, "op builds")]) == 0  # a warning: other runs may never load the op
