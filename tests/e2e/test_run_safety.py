"""The run-directory promises on real launches: one writer per run, a stop before the first step exits with
the preemption code and the same command then starts cleanly, an early failure never blocks the corrected
rerun, a full disk stops with one line and the previous checkpoint intact, and the result works from any
directory.

Launches: a run that holds the directory while another starts, or that is signalled, starts for real
(`start_recipe`); the others are started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher).
"""

import os
import signal
import socket
import time

import pytest
from helpers import launch, run_recipe, start_recipe, tmpfs

from toolkit import checkpoint
from toolkit.checkpoint import rundir
from toolkit.commands import cli
from toolkit.launch.preemption import PREEMPTED_EXIT_CODE

# Timing-sensitive: make test-e2e runs it with nothing beside it.
pytestmark = pytest.mark.alone


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("finetune_llm: error:")]


def wait_for_lock(out, process, timeout: float = 120) -> str:
    """The holder written into the lock: the run has its Accelerator and is about to load data and model."""
    deadline = time.monotonic() + timeout
    while not (out / rundir.LOCK).is_file() or not (out / rundir.LOCK).read_text().strip():
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never took its lock"
        time.sleep(0.02)
    return (out / rundir.LOCK).read_text().strip()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "run"
    run_recipe(out, "train.max_steps=2")
    return out


def test_stop_during_loading_exits_75_and_the_same_command_then_trains(tmp_path):
    out = tmp_path / "run"
    run = start_recipe(out, "train.max_steps=2")
    wait_for_lock(out, run)
    run.send_signal(signal.SIGTERM)
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    assert "stopped by SIGTERM before step 1" in stdout and "Traceback" not in stderr
    assert not (out / "checkpoints").exists() and not (out / "final").exists()
    again = run_recipe(out, "train.max_steps=2")
    assert again.returncode == 0 and (out / "final").is_dir()


def test_an_early_failure_leaves_nothing_that_blocks_the_corrected_rerun(tmp_path):
    out = tmp_path / "run"
    failed = run_recipe(out, "data.train=no/such/file.jsonl", "data.eval=null", check=False)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr
    assert len(error_lines(failed.stderr)) == 1 and "no/such/file.jsonl" in error_lines(failed.stderr)[0]
    assert sorted(p.name for p in out.iterdir()) == sorted([rundir.MARKER, rundir.LOCK, rundir.CONFIG])
    run_recipe(out, "train.max_steps=1")
    assert (out / "final").is_dir() and checkpoint.latest_checkpoint(out).name == "step-1"


def test_a_second_launch_on_a_running_output_dir_is_refused(tmp_path):
    out = tmp_path / "run"
    first = start_recipe(out, "train.max_steps=400", "train.lr_scheduler=constant")
    holder = wait_for_lock(out, first)
    assert holder == f"host {socket.gethostname()} pid {first.pid}"
    second = run_recipe(out, "train.max_steps=400", check=False)
    os.killpg(first.pid, signal.SIGKILL)  # kill -9: the lock goes with the process
    first.communicate()
    assert second.returncode == 2 and "Traceback" not in second.stderr
    assert error_lines(second.stderr) == [
        f"finetune_llm: error: output_dir: {out} is in use by another run ({holder}); wait for it to end "
        "or choose another output_dir"
    ]
    rundir.hold_lock(out).close()  # nothing stale is left


@pytest.mark.multiproc
def test_two_ranks_print_a_refusal_once(tmp_path):
    out = tmp_path / "run"
    held = rundir.hold_lock(out)
    result = run_recipe(out, launch=launch("ddp"), check=False)
    held.close()
    assert result.returncode != 0
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and f"pid {os.getpid()}" in lines[0], result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [rundir.LOCK]


def test_a_full_disk_during_training_stops_with_one_line_and_the_previous_checkpoint(tmp_path):
    with tmpfs(tmp_path / "disk", "30m") as disk:
        out = disk / "run"  # one checkpoint of the tiny LoRA run is about 12 MB: the third does not fit
        result = run_recipe(out, "train.max_steps=4", "train.save_every_steps=1", check=False)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        (line,) = error_lines(result.stderr)
        assert "checkpoint not written" in line and "step-2 is still the newest valid checkpoint" in line
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1", "step-2"]
        assert checkpoint.latest_checkpoint(out).name == "step-2" and not (out / "final").exists()


def test_export_into_the_run_is_refused_and_generate_works_from_any_directory(
    trained, tmp_path, capsys, monkeypatch
):
    step = checkpoint.latest_checkpoint(trained)
    before = sorted(str(p) for p in trained.rglob("*"))
    assert cli.main(["export", str(step), "--out", str(step)]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith(f"ftkit export: error: --out: {step} is or lies inside a training run")
    )
    assert sorted(str(p) for p in trained.rglob("*")) == before
    monkeypatch.chdir(tmp_path)  # far from the repository the base model path was given relative to
    final = os.path.relpath(trained / "final", tmp_path)
    assert (
        cli.main(["generate", "--model", final, "--prompt", "What is 1 + 1?", "--max-new-tokens", "4"]) == 0
    )
    assert capsys.readouterr().out.strip()
