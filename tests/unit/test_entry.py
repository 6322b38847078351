"""How a recipe's process ends (toolkit/entry.py): a run that ends well leaves with the process group still
alive (destroying a gloo group right after the last collective can deadlock: toolkit/distributed.py
`close`); an error or a stop closes the group first, then goes through Python's own exit."""

import pytest
import torch

from toolkit import distributed, entry
from toolkit.errors import UserError


class Left(Exception):
    """Stands in for os._exit: the code it was given."""


@pytest.fixture
def ending(monkeypatch):
    """The order of what the process did on its way out."""
    done = []
    monkeypatch.setattr(entry.distributed, "close", lambda: done.append("close"))

    def leave(code):
        done.append(f"leave {code}")
        raise Left(code)

    monkeypatch.setattr(entry, "leave_at_once", leave)
    monkeypatch.setattr(entry.sys, "argv", ["recipe.py"])
    return done


def test_a_run_that_ends_well_leaves_without_closing_the_group(ending):
    with pytest.raises(Left):
        entry.exit_with(lambda argv: 0, "finetune_llm")
    assert ending == ["leave 0"]


def test_a_mistake_closes_the_group_then_exits_with_its_code(ending):
    def main(argv):
        raise UserError("train.max_steps: must be positive")

    with pytest.raises(SystemExit) as exited:
        entry.exit_with(main, "finetune_llm")
    assert exited.value.code == 2 and ending == ["close"]


def test_a_crash_closes_the_group_and_raises(ending):
    def main(argv):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        entry.exit_with(main, "finetune_llm")
    assert ending == ["close"]


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
