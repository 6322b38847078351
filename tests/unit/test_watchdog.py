"""The stall watchdog, in a process of its own (it ends the process it watches): progress keeps it quiet,
no progress for the timeout ends the process with the stall code, its stacks and one line naming the rank
that stopped answering."""

import json
import subprocess
import sys
import textwrap
import time

from helpers import REPO

from toolkit.train.watchdog import STALL_DIR, STALL_EXIT_CODE, Watchdog

# Rank 0 of 2 with a 2-second timeout: it beats for 4 s (forward passes through a hooked module), then
# waits as in a collective; rank 1's heartbeat was last written a minute ago.
WATCHED = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    import torch
    from toolkit.train.watchdog import Watchdog

    out = Path(sys.argv[1])
    (out / "stall").mkdir(parents=True)
    beat = {"at": time.time() - 60, "doing": "step 7", "pid": 4242, "host": "node-b"}
    (out / "stall" / "heartbeat-rank-1.json").write_text(json.dumps(beat))
    dog = Watchdog(out, rank=0, world=2, timeout_s=2.0, prog="test").start()
    layer = torch.nn.Linear(2, 2)
    layer.register_forward_pre_hook(lambda module, args: dog.touch())
    dog.beat("step 7")
    until = time.monotonic() + 4
    while time.monotonic() < until:
        layer(torch.ones(2))
        time.sleep(0.2)
    print("survived progress", flush=True)
    def waiting_in_a_collective():
        time.sleep(60)
    waiting_in_a_collective()
    """
)


def test_progress_keeps_it_quiet_and_a_stall_ends_the_process_with_stacks_and_one_line(tmp_path):
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-c", WATCHED, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == STALL_EXIT_CODE, run.stderr[-2000:]
    assert run.stdout.strip() == "survived progress"
    assert time.monotonic() - started < 30
    (line,) = [text for text in run.stderr.splitlines() if text.startswith("stalled:")]
    assert "no progress for 2 s" in line
    assert "stopped answering: rank 1 (pid 4242 on node-b" in line and "last in step 7" in line
    assert "waiting: rank 0 in step 7" in line
    stacks = (tmp_path / STALL_DIR / "rank-0.txt").read_text()
    assert "stalled while doing: step 7" in stacks and "waiting_in_a_collective" in stacks


def test_a_closed_watchdog_leaves_no_heartbeat_behind(tmp_path):
    dog = Watchdog(tmp_path, rank=0, world=1, timeout_s=60.0, prog="test").start()
    dog.beat("step 1")
    deadline = time.monotonic() + 30
    while not (tmp_path / STALL_DIR / "heartbeat-rank-0.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert json.loads((tmp_path / STALL_DIR / "heartbeat-rank-0.json").read_text())["doing"] == "step 1"
    dog.close()
    assert not (tmp_path / STALL_DIR).exists()
