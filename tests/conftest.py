"""Shared by every test. Its folder is on sys.path, so tests in tests/unit and tests/e2e import `helpers`."""

import os
import signal
import sys

import datasets
import pytest
import torch
import warm


def share_the_cores() -> None:
    """A pytest-xdist worker shares the machine's cores with the others: unless OMP_NUM_THREADS says
    otherwise, it (and what it starts) computes on its share of them. OpenMP's threads spin while they wait
    for each other, so two workers of two threads each on two cores stall each other at every parallel
    region: the unit tests' heaviest files ran 3.4 times slower so (192 s against 56 s)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


share_the_cores()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "real_launch: its launches go through the real `accelerate launch`/`python`, never a warm start "
        "(tests/warm.py): where the launch itself is what the test is about",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures: a marked test's runs (its module fixtures' too, when it is the first to
    ask for them) start for real."""
    warm.real_launch = item.get_closest_marker("real_launch") is not None


def pytest_sessionfinish(session):
    warm.close_all()


RETRIED: list[str] = []


def pytest_warning_recorded(warning_message, nodeid):
    """Every launch run a second time (tests/helpers.py `LaunchRetried`), pytest-xdist's workers' too."""
    if warning_message.category.__name__ == "LaunchRetried":
        RETRIED.append(nodeid)


def pytest_terminal_summary(terminalreporter):
    """A count of the launches run a second time, with the tests they were in: the warnings summary above
    holds each first try's stderr or stacks."""
    where = f" ({', '.join(RETRIED)})" if RETRIED else ""
    terminalreporter.write_line(f"launches retried: {len(RETRIED)}{where}", yellow=bool(RETRIED))


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A datasets cache of the test's own, so one test's cached tables never answer another's."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps one process-wide state; a test that builds an Accelerator must not fix the next
    test's precision or device (the recipe runs in-process in some unit tests)."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def recipe():
    """recipes/finetune_llm.py as a module, for tests that run its main() in this process."""
    from helpers import load_recipe

    return load_recipe()


@pytest.fixture
def signal_handlers_restored():
    """The recipe installs its stop handlers in this process; put pytest's back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture
def at_the_checkout_root(monkeypatch):
    """Run from the checkout's root (where command lines name recipes/configs/ files)."""
    from helpers import REPO

    monkeypatch.chdir(REPO)


@pytest.fixture
def tiny(tmp_path):
    """A function writing the small model's config.json (with overrides) to a directory, as `--model` and
    `ftkit plan` take it; returns the directory."""
    from helpers import tiny_llama_config

    def write(**overrides) -> str:
        tiny_llama_config(**overrides).to_json_file(tmp_path / "config.json")
        return str(tmp_path)

    return write
