"""The test launcher itself. Its one retry, with the output put back: only for a rank aborting in gloo's
teardown, or a launch that hung, each reported as a `LaunchRetried` warning with the first try's stderr or
stacks. Its warm start (tests/warm.py): each test here runs the same command twice, once through the real
`accelerate launch` (or `python`, or `ftkit train`) and once started warm, and compares what the ranks were
given (their whole environment, argv, sys.path, torch's threads), what they computed (per-step losses and
gradient norms of `ftkit train` under ZeRO-3 with its whole console, equal to the last digit) and how a
failure shows (a rank raising, a rank killed by a signal, a rank that stalls until the test's timeout): the
real path is what the warm one is checked against.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import warm
from helpers import (
    LAUNCH_TIMEOUT,
    REPO,
    TEARDOWN_ABORT,
    LaunchRetried,
    console_lines,
    launch,
    logged,
    run_ftkit_train,
    run_launched,
    step_losses,
)

# Runs the statement given the first time it runs (appending to out/log.txt first), succeeds the second.
SCRIPT = """
import sys, pathlib
out = pathlib.Path(sys.argv[1]); out.mkdir(exist_ok=True)
log = out / "log.txt"
first = not (out.parent / "ran").exists()
(out.parent / "ran").touch()
log.write_text(log.read_text() + "x" if log.exists() else "x")
if first:
    exec(sys.argv[2])
"""
DUMP = REPO / "tests" / "scripts" / "dump_env.py"
# The only variable a rank sees differently: torchrun's per-rank error file lies in a fresh temporary
# folder on every launch. (The rendezvous port is the same here because both launches are given it.)
DIFFERS = {"TORCHELASTIC_ERROR_FILE"}


def test_teardown_abort_runs_again_from_the_same_start_and_is_reported(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "log.txt").write_text("before:")
    command = [sys.executable, "-c", SCRIPT, str(out), f"print('first try'); sys.exit({TEARDOWN_ABORT!r})"]
    with pytest.warns(LaunchRetried, match="aborted in gloo's teardown") as retried:
        result = run_launched(command, keep=out)
    assert TEARDOWN_ABORT in str(retried[0].message)  # the first try's stderr
    assert result.returncode == 0
    assert (out / "log.txt").read_text() == "before:x"  # the first try's write was undone
    assert not list(tmp_path.glob(".*"))  # no backup left behind


def test_any_other_failure_stands(tmp_path):
    out = tmp_path / "out"
    result = run_launched(
        [sys.executable, "-c", SCRIPT, str(out), "sys.exit('Traceback: a real error')"], keep=out
    )
    assert result.returncode == 1 and "a real error" in result.stderr
    assert (out / "log.txt").read_text() == "x"


def test_a_hung_launch_runs_again_from_the_same_start_and_is_reported(tmp_path):
    """The first try stalls where the test ends it (`expire`, as a timeout would); the second succeeds."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "log.txt").write_text("before:")
    command = [sys.executable, "-c", SCRIPT, str(out), "import time; time.sleep(LAUNCH_TIMEOUT)"]
    command[-1] = command[-1].replace("LAUNCH_TIMEOUT", str(LAUNCH_TIMEOUT))
    expire = threading.Event()
    ran = tmp_path / "ran"
    threading.Thread(target=fire_when, args=(ran.exists, expire), daemon=True).start()
    with pytest.warns(LaunchRetried, match="hung: .*timed out after 600 seconds"):
        result = run_launched(command, keep=out, expire=expire)
    assert result.returncode == 0
    assert (out / "log.txt").read_text() == "before:x"
    assert not list(tmp_path.glob(".*"))


def fire_when(ready, expire: threading.Event) -> None:
    """Sets `expire` once `ready()` is true, or at the guard's time limit."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while time.monotonic() < deadline and not ready():
        time.sleep(0.1)
    expire.set()


def both_ways(monkeypatch, command: list[str], out, recipe_imports: bool = False) -> dict:
    """The command run for real and then warm (the same command: the same rendezvous port); what it
    wrote to `out` is moved to out/../real and out/../warm. With `recipe_imports`, each rank imports what a
    recipe's rank does before it writes (tests/scripts/dump_env.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DUMP_RECIPE_IMPORTS": "1" if recipe_imports else "0"}
    results = {}
    for way in ("real", "warm"):
        monkeypatch.setattr(warm, "real_launch", way == "real")
        results[way] = run_launched(command, env, timeout=300)
        if out.exists():
            out.rename(out.parent / way)
    return results


def dump_command(out, config: str | None, *statement: str) -> list[str]:
    head = [sys.executable] if config is None else [sys.executable, "-m", warm.LAUNCHER, *launch(config)]
    return [*head, str(DUMP), str(out), *statement]


def started(out) -> dict:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))}


@pytest.mark.parametrize("config", [None, "single", "ddp", "fsdp", "zero1", "zero2", "zero3"])
def test_a_warm_rank_starts_with_what_accelerate_launch_gives_it(config, monkeypatch, tmp_path):
    """What each config's launcher gives its ranks; under ZeRO-3 after the imports of a recipe's rank too (the
    warm process made them before it forked: they must leave the same state a rank's own imports do)."""
    command = dump_command(tmp_path / "out", config)
    results = both_ways(monkeypatch, command, tmp_path / "out", recipe_imports=config == "zero3")
    runs = {}
    for way, result in results.items():
        assert result.returncode == 0, result.stderr[-3000:]
        runs[way] = started(tmp_path / way)
        for rank in runs[way].values():
            assert rank.pop("pid") != os.getpid() and rank["threads"] == 1
    ranks = 1 if config in (None, "single") else 2
    assert len(runs["real"]) == ranks and runs["warm"].keys() == runs["real"].keys()
    for name, real in runs["real"].items():
        got = runs["warm"][name]
        for key in DIFFERS:
            assert (key in got["env"]) == (key in real["env"]), key
            got["env"].pop(key, None), real["env"].pop(key, None)
        assert got == real, name
    printed = {
        way: sorted(line for line in r.stdout.splitlines() if line.startswith("rank "))
        for way, r in results.items()
    }
    assert printed["warm"] == printed["real"] == [f"rank {r} started" for r in range(2 - ranks, 2)]


@pytest.mark.multiproc
def test_a_warm_ftkit_train_prints_and_trains_like_the_real_one(monkeypatch, tmp_path):
    """`ftkit train --backend zero3` started warm: the command line runs in the fork and the `accelerate
    launch` it starts is a fork of it in turn. What the user reads (progress bars aside, the port its own
    each time), the per-step losses and the gradient norms equal the real command's to the last digit. One
    config: what a warm rank starts with is compared for each (above); ZeRO-3's engine is the one built from
    what the rank was given (the recipe's own DDP and FSDP launches were folded, 80 s here)."""
    out = tmp_path / "run"
    seen = {}
    for way in ("real", "warm"):
        monkeypatch.setattr(warm, "real_launch", way == "real")
        result = run_ftkit_train(out, "zero3")
        lines = [re.sub(r"--main_process_port \d+", "PORT", line) for line in console_lines(result)]
        seen[way] = [line for line in lines if "%|" not in line], step_losses(out), logged(out, "grad_norm")
        out.rename(tmp_path / way)
    assert len(seen["real"][1]) == 4 and "result: held-out eval loss" in seen["real"][0][-3]
    assert "backend deepspeed ZeRO-3" in seen["real"][0][1]
    assert seen["warm"] == seen["real"]


def traceback(stderr: str) -> str:
    """From the first traceback on (what the libraries print as they are imported comes before it)."""
    return stderr[stderr.find("Traceback (most recent call last)") :]


def root_cause(stderr: str) -> list[str]:
    """torchrun's report of the first rank that failed, without its time and pid."""
    cause = stderr.split("Root Cause (first observed failure):")[1].split("=" * 20)[0]
    lines = [re.split(r"\(pid:| by PID", line)[0].strip() for line in cause.splitlines()]
    return [line for line in lines if line and not line.startswith("time ")]


@pytest.mark.parametrize("config", [None, "ddp"])
def test_a_failing_rank_fails_a_warm_launch_the_same_way(config, monkeypatch, tmp_path):
    command = dump_command(tmp_path / "out", config, "raise ValueError('rank 1 fails on purpose')")
    results = both_ways(monkeypatch, command, tmp_path / "out")
    real, got = results["real"], results["warm"]
    assert got.returncode == real.returncode == 1
    if config is None:  # the interpreter's own traceback, frame for frame
        assert traceback(got.stderr) == traceback(real.stderr) != ""
    else:  # the rank's traceback, then torchrun's report (rank 0 may have ended or been stopped by then)
        assert "ValueError: rank 1 fails on purpose" in got.stderr
        assert root_cause(got.stderr) == root_cause(real.stderr)
        assert root_cause(got.stderr)[:2] == ["[0]:", "host      : localhost"]


def test_a_rank_killed_by_a_signal_fails_a_warm_launch_the_same_way(monkeypatch, tmp_path):
    kill = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    results = both_ways(monkeypatch, dump_command(tmp_path / "out", "ddp", kill), tmp_path / "out")
    real, got = results["real"], results["warm"]
    assert got.returncode == real.returncode == 1
    assert root_cause(got.stderr) == root_cause(real.stderr)
    assert "exitcode  : -9" in root_cause(got.stderr)
    assert root_cause(got.stderr)[-1] == "traceback : Signal 9 (SIGKILL) received"


def test_a_stalled_rank_is_ended_by_the_timeout_in_a_warm_launch(monkeypatch, tmp_path):
    """Both ways the test's timeout raises; started warm, its message shows where each rank was (their
    stacks, from faulthandler), and no process of the run outlives it. The test fires the timeout itself
    (`expire`) once rank 0 has ended and rank 1 is in its stall: however slow the start, the stall is what
    it ends. The time limit is only a guard."""
    out = tmp_path / "out"
    stall = f"open({str(out / 'stalled')!r}, 'w').close(); import time; time.sleep({LAUNCH_TIMEOUT})"
    command = dump_command(out, "ddp", stall)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    pids = {}
    for way in ("real", "warm"):
        monkeypatch.setattr(warm, "real_launch", way == "real")
        expire = threading.Event()
        threading.Thread(target=fire_when, args=(lambda: stalled_alone(out), expire), daemon=True).start()
        with pytest.raises(subprocess.TimeoutExpired) as stalled:
            run_launched(command, env, timeout=LAUNCH_TIMEOUT, retry=False, expire=expire)
        assert expire.is_set(), "the launch ended before its ranks had stalled"
        assert b"rank 0 started" in stalled.value.stdout  # bytes, as subprocess.run leaves them
        if way == "warm":  # the launcher's stacks and rank 1's, in its sleep (rank 0 has ended)
            message = str(stalled.value)
            assert message.count("Fatal Python error: Aborted") == 2, message
            assert 'File "<string>", line 1 in <module>\n  File "' + str(DUMP) in message
        pids[way] = [rank["pid"] for rank in started(out).values()]
        out.rename(tmp_path / way)
    time.sleep(1)
    assert [pid for pid in pids["warm"] if warm.alive(pid)] == []
    for pid in pids["real"]:  # subprocess.run kills accelerate launch alone: its ranks are left running
        if warm.alive(pid):
            os.kill(pid, signal.SIGKILL)


def stalled_alone(out) -> bool:
    """Rank 1 is in its stall and rank 0 has ended (its output written)."""
    try:
        pid = json.loads((out / "rank-0.json").read_text())["pid"]
    except (FileNotFoundError, ValueError):  # not yet written, or half
        return False
    return (out / "stalled").exists() and not warm.alive(pid)
