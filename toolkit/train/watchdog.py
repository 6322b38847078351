"""The stall watchdog: when no step, eval batch or checkpoint write has moved for `timeout` seconds, every
rank that can still run dumps its Python stacks into output_dir/stall/, the lowest such rank prints one line
naming what each rank was doing (and which stopped answering), and the process exits with STALL_EXIT_CODE.

Each rank's watchdog thread writes a small heartbeat file beside the stacks every few seconds; a rank whose
heartbeat is old is frozen or dead (it cannot dump its own stacks), the others are waiting on it."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from toolkit import console

# GNU timeout's code: the run ran out of time without finishing; distinct from 2 (mistake) and 75 (stopped).
STALL_EXIT_CODE = 124
STALL_DIR = "stall"


class Watchdog:
    """One rank's watchdog: `beat(doing)` marks progress from the training thread; a daemon thread checks."""

    def __init__(self, output_dir: Path, rank: int, world: int, timeout_s: float, prog: str):
        self.folder = Path(output_dir) / STALL_DIR
        self.rank, self.world, self.timeout_s, self.prog = rank, world, timeout_s, prog
        self.period_s = max(0.5, min(5.0, timeout_s / 8))
        self.doing = "starting"
        self.last = time.monotonic()
        self._armed = False
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ftkit-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def close(self) -> None:
        """The run is over: stop watching and remove this rank's heartbeat (and the folder once empty)."""
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join()
        self._heartbeat(self.rank).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.folder.rmdir()

    def beat(self, doing: str) -> None:
        """Progress: `doing` is what this rank does next (e.g. "step 12", "eval batch 3 at step 10")."""
        self.doing, self.last, self._armed = doing, time.monotonic(), True

    def touch(self) -> None:
        """Progress in what this rank was already doing (a forward pass)."""
        self.last = time.monotonic()

    def forward_hook(self, module, args) -> None:
        """`touch` as a forward pre-hook: every forward pass of the hooked module counts as progress."""
        self.touch()

    def _watch(self) -> None:
        while not self._closed.wait(self.period_s):
            if not self._armed:
                continue
            self._write_heartbeat()
            if time.monotonic() - self.last > self.timeout_s:
                self._fire()

    def _heartbeat(self, rank: int) -> Path:
        return self.folder / f"heartbeat-rank-{rank}.json"

    def _write_heartbeat(self) -> None:
        record = {"at": time.time(), "doing": self.doing, "pid": os.getpid(), "host": socket.gethostname()}
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._heartbeat(self.rank)
        temp = path.with_suffix(".tmp")
        temp.write_text(json.dumps(record))
        temp.replace(path)

    def _fire(self) -> None:
        with open(self.folder / f"rank-{self.rank}.txt", "w") as stacks:
            stacks.write(f"rank {self.rank} (pid {os.getpid()}), stalled while doing: {self.doing}\n")
            stacks.flush()
            faulthandler.dump_traceback(stacks, all_threads=True)
        line, first_alive = self.summary()
        if first_alive == self.rank:
            console.close_progress_bars()  # the training thread is blocked; the line gets a line of its own
            print(line, file=sys.stderr, flush=True)
        console.finish(self.prog, STALL_EXIT_CODE, "")
        os._exit(STALL_EXIT_CODE)

    def summary(self) -> tuple[str, int]:
        """(the one line, the lowest rank still answering)."""
        now, stale_s = time.time(), 3 * self.period_s + 2.0
        waiting, frozen = [], []
        for rank in range(self.world):
            try:
                beat = json.loads(self._heartbeat(rank).read_text())
            except (OSError, ValueError):
                frozen.append(f"rank {rank} (no heartbeat)")
                continue
            if rank == self.rank or now - beat["at"] <= stale_s:
                waiting.append((rank, f"rank {rank} in {beat['doing']}"))
            else:
                where = f"pid {beat['pid']} on {beat['host']}, silent {now - beat['at']:.0f} s"
                frozen.append(f"rank {rank} ({where}, last in {beat['doing']})")
        parts = [f"no progress for {self.timeout_s:g} s"]
        if frozen:
            parts.append("stopped answering: " + ", ".join(frozen))
        parts.append("waiting: " + ", ".join(text for _, text in waiting))
        line = f"stalled: {'; '.join(parts)}; stacks in {self.folder}/; exit {STALL_EXIT_CODE}"
        return line, min(rank for rank, _ in waiting)
