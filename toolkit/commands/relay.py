"""Run the launcher, pass on what the user needs to read, and exit with the worker's own code.

The workers tell us how they ended through files in a fresh directory (FTKIT_EXIT_DIR, see
toolkit.console): torchrun turns any worker's failure into exit 1 and a ChildFailedError traceback. So from
the launcher's first failure report on, its stderr is held back; when a worker reported its exit, that report
is the one line shown (once, however many ranks sent it) and the held text is dropped; when none did
(a crash, a programming error) the held text, tracebacks included, is shown as it was.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from toolkit import console

LAUNCHER_FAILURE = re.compile(r"Traceback \(most recent call last\)|[EW]\d{4} .*torch/distributed/elastic/")
SEGMENT = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)")
PREEMPTED = 75


class Stream:
    """One of the launcher's output streams, passed on segment by segment (tqdm redraws end in \\r)."""

    def __init__(self, out, verbose: bool, hold_on_failure: bool):
        self.out, self.verbose, self.hold_on_failure = out, verbose, hold_on_failure
        self.held: list[str] = []
        self._pending = ""

    def feed(self, text: str) -> None:
        self._pending += text
        end = max(self._pending.rfind("\n"), self._pending.rfind("\r")) + 1
        for segment in SEGMENT.findall(self._pending[:end]):
            self._emit(segment)
        self._pending = self._pending[end:]
        self.out.flush()

    def close(self) -> None:
        if self._pending:
            self._emit(self._pending + "\n")
        self.out.flush()

    def _emit(self, segment: str) -> None:
        if self.verbose:
            self.out.write(segment)
            return
        if self.hold_on_failure and (self.held or LAUNCHER_FAILURE.search(segment)):
            self.held.append(segment)
        elif not console.is_noise(segment.rstrip("\r\n")):
            self.out.write(segment)


def _pump(pipe, stream: Stream) -> None:
    while chunk := os.read(pipe.fileno(), 65536):
        stream.feed(chunk.decode(errors="replace"))
    stream.close()


def run(argv: list[str], env, recipe: str, verbose: bool = False) -> int:
    """Run `accelerate launch ...` (argv as displayed) with this Python; return the workers' exit code."""
    command = [sys.executable, "-m", "accelerate.commands.launch", *argv[2:]]
    with tempfile.TemporaryDirectory(prefix="ftkit-exit-") as exit_dir:
        child_env = {
            **env,
            console.EXIT_DIR_ENV: exit_dir,
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        }
        if verbose:
            child_env[console.VERBOSE_ENV] = "1"
        proc = subprocess.Popen(command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        streams = [Stream(sys.stdout, verbose, False), Stream(sys.stderr, verbose, True)]
        pumps = [
            threading.Thread(target=_pump, args=(pipe, stream), daemon=True)
            for pipe, stream in zip((proc.stdout, proc.stderr), streams)
        ]
        for pump in pumps:
            pump.start()
        previous = {sig: signal.signal(sig, lambda s, f: proc.send_signal(s)) for sig in _FORWARDED}
        try:
            launcher_code = proc.wait()
            for pump in pumps:
                pump.join()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return settle(launcher_code, console.read_exits(Path(exit_dir)), streams[1], recipe)


# SLURM's --signal=B:TERM and a scheduler's stop reach this process; torchrun passes them to the workers.
_FORWARDED = (signal.SIGTERM, signal.SIGINT)


def settle(launcher_code: int, exits: list[dict], stderr: Stream, recipe: str) -> int:
    """The exit code to hand on, after showing each worker's message once (or the held launcher text)."""
    if not exits:
        stderr.out.write("".join(stderr.held))
        stderr.out.flush()
        return launcher_code
    for message in dict.fromkeys(e["message"] for e in exits if e.get("message")):
        print(f"{recipe}: error: {message}", file=stderr.out, flush=True)
    codes = [e["code"] for e in exits]
    if 2 in codes:
        return 2
    return PREEMPTED if all(code == PREEMPTED for code in codes) else max(codes)
