"""Graceful stop on SIGTERM / SIGINT: finish the optimizer step, checkpoint, exit with PREEMPTED_EXIT_CODE.
A second signal exits at once."""

from __future__ import annotations

import os
import signal

# EX_TEMPFAIL: "try again later" — a scheduler can requeue the job and `train.resume=auto` continues it.
PREEMPTED_EXIT_CODE = 75


class StopRequest:
    """Installs the handlers; the recipe agrees on `requested` across ranks so all stop after one step."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        self.signal_name = ""
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signal_name:
            os._exit(128 + signum)
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return bool(self.signal_name)
