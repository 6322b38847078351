"""A turn's environment requests (tool calls, OpenEnv resets and steps) across the round's conversations,
at most grpo.environment.concurrency at once, their results in the conversations' order."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor, wait


@contextlib.contextmanager
def pooled(size: int):
    """Threads for `size` environment requests at once (grpo.environment.concurrency), or None for 1: each
    request then runs on the calling thread."""
    if size == 1:
        yield None
        return
    with ThreadPoolExecutor(max_workers=size, thread_name_prefix="environment") as pool:
        yield pool


def each(pool: ThreadPoolExecutor | None, calls: list) -> list:
    """Every zero-argument call's result, in the order given: at most the pool's size running at once (one
    after another without a pool). Each call touches one conversation (and its session) alone, so the
    results are those of one at a time; the first error, in that order, is raised once all have finished."""
    if pool is None:
        return [call() for call in calls]
    futures = [pool.submit(call) for call in calls]
    wait(futures)
    return [future.result() for future in futures]
