"""Warm starts of the launched test runs: `python script.py ...`, `python -m accelerate.commands.launch ...
script.py ...` and `python -m toolkit.commands.cli ...` (`ftkit train` and the other commands, whose own
`accelerate launch` starts warm in turn) started by fork from a process (tests/zygote.py) that has already
imported torch, transformers, peft, accelerate, DeepSpeed, datasets and the toolkit, one per pytest worker and
environment. The launcher and every rank are still processes of their own, with the environment, console and
exit status the real command gives (accelerate's and torchrun's own code computes them); what they skip is the
imports (5 to 13 seconds a process on two cores). `FTKIT_TEST_LAUNCH=real` runs every launch for real, and a
test or module marked `real_launch` does so by itself (where the launch itself is what it tests)."""

from __future__ import annotations

import contextlib
import json
import locale
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SWITCH = "FTKIT_TEST_LAUNCH"
ZYGOTE = Path(__file__).resolve().parent / "zygote.py"
LAUNCHER = "accelerate.commands.launch"
CLI = "toolkit.commands.cli"
# Variables that differ from one test to the next and that nothing reads while importing.
PER_TEST = {"PYTEST_CURRENT_TEST"}
# Warm processes kept per pytest worker, one per environment (each holds the imported libraries).
KEEP = 3
STARTUP_TIMEOUT = 600
# A run that times out gets SIGABRT first (`dump_stacks`): with PYTHONFAULTHANDLER set (tests/helpers.py
# sets it), each of its processes writes every thread's Python stack to its stderr, so the test's message
# shows where it hung.
STACKS_WAIT = 5.0

real_launch = False
"""Set for the running test by tests/conftest.py: True where it is marked `real_launch`."""


def enabled() -> bool:
    return os.environ.get(SWITCH, "warm") != "real" and not real_launch


def warm_argv(command: list[str], env: dict) -> list[str] | None:
    """The argv after `python` if the command can start warm: a script, accelerate's launcher or ftkit's
    command line, with no start-up code of its own (a sitecustomize on PYTHONPATH runs in every fresh
    interpreter)."""
    if len(command) < 2 or command[0] != sys.executable or startup_code(env):
        return None
    if command[1:3] in (["-m", LAUNCHER], ["-m", CLI]):
        return list(command[1:])
    if command[1].endswith(".py") and os.path.isfile(command[1]):
        return list(command[1:])
    return None


def startup_code(env: dict) -> bool:
    folders = [Path(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    hooks = ("sitecustomize.py", "usercustomize.py", "sitecustomize", "usercustomize")
    return any((folder / hook).exists() for folder in folders for hook in hooks)


class Zygote:
    """One warm process, started with `env`; runs one command at a time."""

    def __init__(self, env: dict):
        self.stamp = source_stamp()
        log, self.log = tempfile.mkstemp(prefix="zygote-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, str(ZYGOTE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            cwd=ZYGOTE.parent.parent,
        )
        os.close(log)
        self.pending = b""
        self.reply(time.monotonic() + STARTUP_TIMEOUT)

    def reply(self, deadline: float, expire=None) -> dict | None:
        """The next reply line, or None once `deadline` passes or `expire` (an event) is set."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or (expire is not None and expire.is_set()):
                return None
            if not select.select([fd], [], [], left if expire is None else min(left, 0.2))[0]:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                log = Path(self.log).read_text()[-4000:]
                raise RuntimeError(f"the warm process ended ({self.proc.wait()}):\n{log}")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line)

    def run(self, argv: list[str], env: dict, cwd: Path, timeout: float | None, command: list[str], expire):
        with tempfile.TemporaryDirectory(prefix="warm-") as folder:
            files = {name: os.path.join(folder, name) for name in ("stdout", "stderr", "pids")}
            request = dict(argv=argv, env=env, cwd=str(cwd), **files)
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            deadline = time.monotonic() + (timeout if timeout is not None else 10**9)
            launcher = self.reply(time.monotonic() + STARTUP_TIMEOUT)["pid"]
            timed_out = True
            try:
                done = self.reply(deadline, expire)
                timed_out = done is None
            finally:
                # (or interrupted) the launcher and its ranks end here, as subprocess.run's would, after
                # writing their stacks where faulthandler is on
                if timed_out:
                    dump_stacks(launcher, files["pids"])
                    kill_all(launcher, files["pids"], signal.SIGKILL)
                    if self.reply(time.monotonic() + 60) is None:
                        raise RuntimeError(f"the warm process never saw its launcher {launcher} end")
            stdout, stderr = (read_bytes(files[name]) for name in ("stdout", "stderr"))
            if timed_out:  # undecoded, as subprocess.run leaves the output of a command it timed out
                raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
            return subprocess.CompletedProcess(command, done["status"], decode(stdout), decode(stderr))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        os.unlink(self.log)


def dump_stacks(launcher: int, pids_file: str) -> None:
    """SIGABRT to the launcher's session, then to each rank's, one at a time (they share one stderr), each
    given up to STACKS_WAIT seconds to write its stacks and end. The launcher goes first: a rank's end would
    have it stop the others with SIGTERM, before they had written theirs."""
    for pid in [launcher, *rank_pids(pids_file)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGABRT)
        deadline = time.monotonic() + STACKS_WAIT
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether process `pid` exists and has not yet ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def rank_pids(pids_file: str) -> list[int]:
    with contextlib.suppress(FileNotFoundError):
        return [int(line) for line in Path(pids_file).read_text().split()]
    return []


def kill_all(launcher: int, pids_file: str, sig: int) -> None:
    """`sig` to the launcher's session and to each rank's (each rank has a session of its own)."""
    for pid in [launcher, *rank_pids(pids_file)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)


def read_bytes(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:  # the launcher ended before it opened its output
        return b""


def decode(data: bytes) -> str:
    """What subprocess.run(text=True) makes of a stream: the locale's encoding, universal newlines."""
    text = data.decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")


_zygotes: dict[tuple, Zygote] = {}


def source_stamp() -> float:
    """The newest change to the toolkit's or the recipes' code: a warm process older than it is replaced."""
    root = ZYGOTE.parent.parent
    files = [*root.glob("toolkit/**/*.py"), *root.glob("recipes/*.py")]
    return max((f.stat().st_mtime for f in files), default=0.0)


def zygote_for(env: dict) -> Zygote:
    key = tuple(sorted((k, v) for k, v in env.items() if k not in PER_TEST))
    if key in _zygotes and _zygotes[key].stamp < source_stamp():
        _zygotes.pop(key).close()
    if key not in _zygotes:
        if len(_zygotes) >= KEEP:
            _zygotes.pop(next(iter(_zygotes))).close()
        _zygotes[key] = Zygote({k: v for k, v in env.items() if k not in PER_TEST})
    _zygotes[key] = _zygotes.pop(key)  # the most recently used last
    return _zygotes[key]


def run(
    command: list[str], env: dict, cwd: Path, timeout: float | None, expire=None
) -> subprocess.CompletedProcess:
    """`subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)`,
    started warm (the command must be one `warm_argv` accepts); `expire`, an event, ends it as the
    timeout would once set."""
    return zygote_for(env).run(warm_argv(command, env), env, cwd, timeout, command, expire)


def close_all() -> None:
    while _zygotes:
        _zygotes.popitem()[1].close()
