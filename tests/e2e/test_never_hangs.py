"""A run never hangs in silence: a stop during data preparation ends it at once with the preemption code,
leaving no worker and no half-written cache behind; a rank frozen (SIGSTOP) in a step or a checkpoint
write ends the launch with one line, the stacks and the stall exit code, and the last checkpoint resumes.

Launches: the stalled and signalled runs start for real (`start_recipe` and the recipe's own command), as a
user's would; the run that resumes afterwards is started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the
real launcher).
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import REPO, launch, recipe_command, run_recipe, start_recipe, step_losses
from warm import alive

from toolkit import checkpoint, console
from toolkit.launch.preemption import PREEMPTED_EXIT_CODE
from toolkit.train.watchdog import STALL_EXIT_CODE

# Timing-sensitive: make test-e2e runs it with nothing beside it.
pytestmark = pytest.mark.alone


CHATS = 20_000  # a few seconds of encoding on two workers here


def children(pid: int) -> list[int]:
    path = f"/proc/{pid}/task/{pid}/children"
    return [int(p) for p in open(path).read().split()] if os.path.exists(path) else []


def write_chats(path, count: int) -> None:
    with open(path, "w") as out:
        for i in range(count):
            question = f"What is {i % 97} + {i % 89}? Please show the sum of these two numbers."
            messages = [
                {"role": "user", "content": question},
                {"role": "assistant", "content": str(i % 97 + i % 89)},
            ]
            out.write(json.dumps({"messages": messages}) + "\n")


def test_sigterm_while_encoding_exits_75_and_leaves_no_worker(tmp_path):
    data = tmp_path / "chats.jsonl"
    write_chats(data, CHATS)
    command, env = recipe_command(
        tmp_path / "run", f"data.train={data}", "data.eval=null", "data.num_proc=2", "train.max_steps=2"
    )
    env["HF_DATASETS_CACHE"] = str(tmp_path / "cache")  # encoded here, not answered from a shared cache
    run = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while len(workers := children(run.pid)) < 2:
        assert run.poll() is None, run.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the encoding workers never started"
        time.sleep(0.05)
    time.sleep(1.0)  # in the middle of encoding
    assert run.poll() is None, "encoding finished before the stop: make CHATS larger"
    run.send_signal(signal.SIGTERM)  # the main process alone, as a scheduler's stop of one process is
    stdout, stderr = run.communicate(timeout=60)
    assert run.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    assert "stopped by SIGTERM before step 1" in stdout and "Traceback" not in stderr
    assert not [pid for pid in workers if alive(pid)]
    assert not (tmp_path / "run" / "checkpoints").exists()
    # The stop cut the encoding short: no cache entry, complete or half-written, was left.
    assert not list((tmp_path / "cache" / "ftkit").glob("*"))


# A frozen rank: the stall watchdog on the other ends the launch within the configured time.
STALL = ["train.stall_timeout_minutes=0.15", "train.max_steps=400", "train.lr_scheduler=constant"]


def rank_pid(launcher: int, rank: int) -> int | None:
    """The recipe process of `rank` among the launcher's descendants."""
    todo = children(launcher)
    while todo:
        pid = todo.pop()
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if f"RANK={rank}".encode() in environ and b"finetune_llm.py" in command:
            return pid
        todo += children(pid)
    return None


def start_two_ranks(out, exits, *overrides):
    return start_recipe(out, *STALL, *overrides, launch=launch("ddp"), env={console.EXIT_DIR_ENV: str(exits)})


def freeze_rank_one_when(run, ready, timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    while not ready() or (pid := rank_pid(run.pid, 1)) is None:
        assert run.poll() is None, run.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never got there"
        time.sleep(0.005)
    os.kill(pid, signal.SIGSTOP)
    return pid


def end_of_stalled_run(run, frozen: int, exits) -> tuple[str, int]:
    """(stderr, the exit code rank 0 reported): rank 0 must end by itself within the stall timeout and a
    margin; the frozen rank, which the launcher would SIGKILL after its 30 s grace, is killed here then."""
    reported = exits / "rank-0.json"
    deadline = time.monotonic() + 60
    try:
        while not reported.exists():
            assert run.poll() is None, run.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "rank 0 never ended"
            time.sleep(0.1)
        os.kill(frozen, signal.SIGKILL)
        _, stderr = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        subprocess.run(["kill", "-9", str(frozen)], capture_output=True)
    return stderr, json.loads(reported.read_text())["code"]


def stall_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("stalled:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.mark.multiproc
def test_a_rank_frozen_mid_step_ends_the_run_with_one_line_stacks_and_the_stall_code(tmp_path):
    out, exits = tmp_path / "run", tmp_path / "exits"
    exits.mkdir()
    run = start_two_ranks(out, exits)
    frozen = freeze_rank_one_when(run, lambda: len(step_losses(out)) >= 3)
    stderr, code = end_of_stalled_run(run, frozen, exits)
    assert code == STALL_EXIT_CODE
    line = stall_line(stderr)
    assert "no progress for 9 s" in line and "stopped answering: rank 1" in line, line
    assert "waiting: rank 0 in step" in line and f"{out / 'stall'}" in line
    stacks = (out / "stall" / "rank-0.txt").read_text()
    assert "stalled while doing: step" in stacks and "Thread" in stacks and "finetune_llm.py" in stacks


@pytest.mark.multiproc
def test_a_rank_frozen_in_a_checkpoint_write_keeps_the_previous_checkpoint_and_resume_works(tmp_path):
    out, exits = tmp_path / "run", tmp_path / "exits"
    exits.mkdir()
    run = start_two_ranks(out, exits, "train.save_every_steps=2")
    saving = out / "checkpoints" / ".step-4.tmp"
    frozen = freeze_rank_one_when(run, saving.exists)
    stderr, code = end_of_stalled_run(run, frozen, exits)
    assert code == STALL_EXIT_CODE
    assert "waiting: rank 0 in the checkpoint of step 4" in stall_line(stderr)
    assert checkpoint.latest_checkpoint(out).name == "step-2"
    resumed = run_recipe(out, *STALL, "train.max_steps=3", launch=launch("ddp"))
    assert f"resumed from {out / 'checkpoints' / 'step-2'}" in resumed.stdout
    assert len(step_losses(out)) == 3
