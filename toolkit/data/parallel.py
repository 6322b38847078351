"""An ordered map over worker processes: results come back in input order, so N processes produce exactly
what one does."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator

# The function each worker process applies, set once per worker (tasks then carry only their input).
_worker_fn: Callable | None = None


def default_num_proc(cap: int = 8) -> int:
    """The cores this process may run on, at most `cap` (beyond it, reading and writing dominate)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not every platform reports affinity
        cores = os.cpu_count() or 1
    return max(1, min(cores, cap))


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
    context = multiprocessing.get_context(method)
    with context.Pool(num_proc, initializer=_start_worker, initargs=(fn,)) as pool:
        yield from _bounded(pool, [first, second], items, 2 * num_proc)


def _bounded(pool, head: list, items: Iterator, window: int) -> Iterator:
    """Pool results in order, never more than `window` submitted and not yet taken (Pool.imap would read
    the whole input ahead)."""
    pending = [pool.apply_async(_run, (item,)) for item in head]
    for item in items:
        while len(pending) >= window:
            yield pending.pop(0).get()
        pending.append(pool.apply_async(_run, (item,)))
    for result in pending:
        yield result.get()


def _start_worker(fn: Callable) -> None:
    global _worker_fn
    _worker_fn = fn
    # Each worker is one of num_proc processes already: the tokenizer's own thread pool would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _run(item):
    return _worker_fn(item)
