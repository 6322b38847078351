"""A run never hangs in silence: a stop during data preparation ends it at once with the preemption code,
leaving no worker and no half-written cache behind."""

import json
import os
import signal
import subprocess
import time

from helpers import REPO, recipe_command

from toolkit.preemption import PREEMPTED_EXIT_CODE

CHATS = 20_000  # a few seconds of encoding on two workers here


def children(pid: int) -> list[int]:
    path = f"/proc/{pid}/task/{pid}/children"
    return [int(p) for p in open(path).read().split()] if os.path.exists(path) else []


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


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
