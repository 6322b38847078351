"""Graceful stop on SIGTERM / SIGINT: finish the optimizer step, checkpoint, exit with PREEMPTED_EXIT_CODE.
A second signal exits at once. Before the first step nothing needs saving, so there a stop ends the
work at once (`StopRequest.interruptible`)."""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager

from toolkit.distributed import any_rank

# EX_TEMPFAIL: "try again later" — a scheduler can requeue the job and `train.resume=auto` continues it.
PREEMPTED_EXIT_CODE = 75
# Launchers forward the signal they got to workers that often got it too (Ctrl-C reaches the whole process
# group; torchrun passes SIGTERM on): a repeat this soon is the same request, not a second one.
REPEAT_WINDOW_S = 2.0


class Stopped(Exception):
    """A stop request ended the run where nothing needed saving; the message says so."""


class StopRequest:
    """Installs the handlers; the recipe agrees on `requested` across ranks so all stop after one step."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        self.signal_name = ""
        self._first_at = 0.0
        self._interrupt = ""  # while set: what a stop interrupts, raised as Stopped at once
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.signal_name and now - self._first_at > REPEAT_WINDOW_S:
            os._exit(128 + signum)
        if not self.signal_name:
            self.signal_name, self._first_at = signal.Signals(signum).name, now
        if self._interrupt:
            raise self.stopped_before(self._interrupt)

    @property
    def requested(self) -> bool:
        return bool(self.signal_name)

    def agreed(self, accelerator) -> bool:
        """Collective: true on every rank when any rank was asked to stop."""
        return any_rank(accelerator, self.requested)[0]

    @contextmanager
    def interruptible(self, before: str):
        """Work a stop may cut short (loading, encoding): a stop request raises Stopped ("stopped by
        SIGTERM before <before>") at once, and so does any failure once a stop was asked for (a worker or
        peer ended by the same signal)."""
        self._interrupt = before
        try:
            if self.requested:
                raise self.stopped_before(before)
            yield
        except Stopped:
            raise
        except (Exception, KeyboardInterrupt) as exc:
            if self.requested:  # the handler's Stopped may come back wrapped by the library it went through
                raise self.stopped_before(before) from exc
            raise
        finally:
            self._interrupt = ""

    def stopped_before(self, what: str) -> Stopped:
        """The exception that ends a run stopped before `what` (e.g. "step 1"): nothing new to save."""
        self._interrupt = ""
        return Stopped(f"stopped by {self.signal_name or 'another rank'} before {what}; nothing new to save")
