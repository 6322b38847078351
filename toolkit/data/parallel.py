"""An ordered map over worker processes: results come back in input order, so N processes produce exactly
what one does.

Workers start with the default signal dispositions (a forked child would otherwise inherit the run's
graceful-stop handler and ignore the SIGTERM meant to end it) and leave stopping to the parent. A pool
ends by shutting down after its last task, never by terminating workers that may hold a queue's lock; a
worker that dies is reported as `WorkerLost` instead of leaving the parent waiting for its result."""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

# The function each worker process applies, set once per worker (tasks then carry only their input).
_worker_fn: Callable | None = None


class WorkerLost(RuntimeError):
    """A worker process ended before returning its result (killed by a signal, out of memory)."""


def default_num_proc(cap: int = 8) -> int:
    """The cores this process may run on, at most `cap` (beyond it, reading and writing dominate)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not every platform reports affinity
        cores = os.cpu_count() or 1
    return max(1, min(cores, cap))


def default_signals() -> None:
    """What a process ftkit starts runs first: SIGTERM ends it and SIGINT raises KeyboardInterrupt, as in
    any fresh Python, whatever handlers the parent had installed."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def ordered_map(fn: Callable, items: Iterable, num_proc: int) -> Iterator:
    """fn(item) for each item, in order; with num_proc > 1 on worker processes, a bounded number of items
    in flight so memory stays that of a few items whatever the input's length."""
    items = iter(items)
    if num_proc <= 1:
        yield from map(fn, items)
        return
    first = next(items, None)
    if first is None:
        return
    second = next(items, None)
    if second is None:  # one item: a pool would only add start-up time
        yield fn(first)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = ProcessPoolExecutor(
        num_proc, multiprocessing.get_context(method), initializer=_start_worker, initargs=(fn,)
    )
    try:
        yield from _bounded(pool, [first, second], items, 2 * num_proc)
    except BrokenProcessPool as exc:
        raise WorkerLost(f"a worker process ended without its result ({exc})") from None
    finally:
        # Waits for the tasks already running (at most num_proc), drops the queued ones; workers then
        # leave on their own, so none is left behind and none is killed mid-task.
        pool.shutdown(wait=True, cancel_futures=True)


def _bounded(pool: ProcessPoolExecutor, head: list, items: Iterator, window: int) -> Iterator:
    """Pool results in order, never more than `window` submitted and not yet taken (Executor.map would
    read the whole input ahead)."""
    pending: list[Future] = [pool.submit(_run, item) for item in head]
    for item in items:
        while len(pending) >= window:
            yield pending.pop(0).result()
        pending.append(pool.submit(_run, item))
    while pending:
        yield pending.pop(0).result()


def _start_worker(fn: Callable) -> None:
    global _worker_fn
    default_signals()
    _worker_fn = fn
    # Each worker is one of num_proc processes already: the tokenizer's own thread pool would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _run(item):
    return _worker_fn(item)
