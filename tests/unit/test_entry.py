"""How a recipe's process ends (toolkit/entry.py): on every path, with the exit code Python would give
that ending, without Python's teardown and without destroying the process group (either can end a gloo
run in an abort or a deadlock); the streams flushed, and a failed run's atexit handlers run. Here in a
child process of its own with a real gloo group, as a rank ends."""

import subprocess
import sys

import pytest
import torch

from toolkit import distributed

# A one-process gloo group with a collective done, then the ending under test. A destroyed group, or
# Python's teardown (the atexit line printed by an object's finaliser at interpreter exit), would show.
CHILD = """
import atexit, os, signal, sys, torch, torch.distributed as dist
from toolkit.entry import leave
from toolkit.errors import UserError
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
dist.all_reduce(torch.ones(1))
dist.destroy_process_group = lambda *a, **k: print("destroyed", flush=True)
atexit.register(lambda: print("atexit ran", flush=True))
class Teardown:
    def __del__(self):
        print("torn down", flush=True)
keep = Teardown()
def body():
    print("partial line", end="")
    {ending}
leave(body)
"""
ENDINGS = {
    "return 0": (0, ""),
    "return None": (0, ""),
    "return 2": (2, "atexit ran"),
    "raise RuntimeError('a bug')": (1, "atexit ran"),
    "sys.exit('bad input')": (1, "atexit ran"),
    "raise KeyboardInterrupt": (-2, "atexit ran"),
}


@pytest.mark.parametrize("ending", ENDINGS)
def test_every_ending_leaves_with_its_code_and_no_teardown(ending):
    code = CHILD.format(ending=ending)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    status, atexit_line = ENDINGS[ending]
    assert done.returncode == status, done.stderr
    assert done.stdout.startswith("partial line")  # flushed though it had no newline
    assert "destroyed" not in done.stdout and "torn down" not in done.stdout
    assert ("atexit ran" in done.stdout) == bool(atexit_line)
    if "RuntimeError" in ending:  # the traceback, as Python prints it
        assert "Traceback (most recent call last)" in done.stderr and "RuntimeError: a bug" in done.stderr
    if "sys.exit" in ending:
        assert done.stderr.strip() == "bad input"


def test_ending_the_training_finishes_the_trackers_and_keeps_the_group(monkeypatch):
    finished = []

    class Tracker:
        def finish(self):
            finished.append(self)

    class Accelerator:
        trackers = [Tracker(), Tracker()]

    def destroy(group=None):
        raise AssertionError("the process group was destroyed")

    monkeypatch.setattr(torch.distributed, "destroy_process_group", destroy)
    distributed.end_training(Accelerator())
    assert finished == Accelerator.trackers
