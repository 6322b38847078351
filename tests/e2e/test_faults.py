"""No run is lost: preemption, kill -9 and a diverging loss each leave a valid checkpoint and a clear
message, and the run continues from it (a full disk: tests/unit/test_checkpoint_save.py).

Launches: the runs that are signalled or killed start for real (`start_recipe`), as a user's would; the runs
that continue from them are started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher).
"""

import os
import signal
import time

import pytest
from helpers import REPO, free_port, run_recipe, start_recipe, step_losses

from toolkit import checkpoint
from toolkit.launch.preemption import PREEMPTED_EXIT_CODE
from toolkit.train.metrics import read_metrics

# A constant schedule, so a run told max_steps=400 and one told max_steps=N take the same steps.
# Timing-sensitive: make test-e2e runs it with nothing beside it.
pytestmark = pytest.mark.alone


LONG = ["train.max_steps=400", "train.learning_rate=1e-4", "train.lr_scheduler=constant"]


def wait_for_steps(out, count: int, process, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(step_losses(out)) < count:
        assert process.poll() is None, process.communicate()[1][-4000:]
        assert time.monotonic() < deadline, "the run never reached the expected step"
        time.sleep(0.2)


def complete_checkpoints(out) -> list[int]:
    return sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step-*") if checkpoint.is_complete(p))


@pytest.mark.multiproc
def test_sigterm_under_two_processes_saves_then_resume_matches_a_straight_run(tmp_path):
    ddp = ["--config_file", str(REPO / "accelerate_configs" / "ddp.yaml"), "--num_processes", "2"]
    out = tmp_path / "preempted"
    run = start_recipe(out, *LONG, launch=[*ddp, "--main_process_port", str(free_port())])
    wait_for_steps(out, 3, run)
    os.killpg(run.pid, signal.SIGTERM)  # as Ctrl-C or a scheduler does: the launcher and every worker
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode != 0
    assert "stopped by SIGTERM after step" in stdout, stderr[-3000:]
    stopped_at = complete_checkpoints(out)[-1]
    assert stopped_at == len(step_losses(out)) >= 3

    total = stopped_at + 3
    resumed = run_recipe(
        out,
        f"train.max_steps={total}",
        "train.learning_rate=1e-4",
        "train.lr_scheduler=constant",
        launch=[*ddp, "--main_process_port", str(free_port())],
    )
    assert f"resumed from {out / 'checkpoints' / f'step-{stopped_at}'}" in resumed.stdout
    straight = tmp_path / "straight"
    run_recipe(
        straight,
        f"train.max_steps={total}",
        "train.learning_rate=1e-4",
        "train.lr_scheduler=constant",
        launch=[*ddp, "--main_process_port", str(free_port())],
    )
    assert len(step_losses(out)) == total
    assert step_losses(out) == pytest.approx(step_losses(straight), rel=1e-6)


def test_sigint_single_process_exits_with_the_documented_code(tmp_path):
    out = tmp_path / "run"
    run = start_recipe(out, *LONG)
    wait_for_steps(out, 2, run)
    run.send_signal(signal.SIGINT)
    run.communicate(timeout=300)
    assert run.returncode == PREEMPTED_EXIT_CODE
    assert complete_checkpoints(out) == [len(step_losses(out))]


def test_kill_9_at_any_moment_leaves_only_complete_checkpoints(tmp_path):
    out = tmp_path / "run"
    run = start_recipe(out, *LONG, "train.save_every_steps=1")
    wait_for_steps(out, 4, run)
    time.sleep(0.37)  # land somewhere inside a step or a save
    run.kill()
    run.communicate()
    for path in (out / "checkpoints").iterdir():
        assert checkpoint.is_complete(path) or path.name.endswith(".tmp"), path
    newest = complete_checkpoints(out)[-1]
    result = run_recipe(
        out, f"train.max_steps={newest + 2}", "train.save_every_steps=1", "train.learning_rate=1e-4"
    )
    assert f"at step {newest}" in result.stdout
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == list(
        range(1, newest + 3)
    )


def test_diverging_loss_stops_naming_the_step(tmp_path):
    out = tmp_path / "run"
    result = run_recipe(
        out, "train.learning_rate=1e30", "train.max_steps=30", "train.max_grad_norm=0", check=False
    )
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "non-finite in a row" in last and "step " in last
    assert not (out / "final").exists()


def test_diverging_loss_with_skip_finishes_and_counts(tmp_path):
    out = tmp_path / "run"
    run_recipe(
        out, "train.learning_rate=1e30", "train.max_steps=8", "train.max_grad_norm=0", "train.nonfinite=skip"
    )
    lines = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert lines[-1]["skipped_steps"] > 0
