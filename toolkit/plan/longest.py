"""`ftkit plan --longest-seq`: how long a sequence each setup and layout fits, found by bisection over the
memory estimate (which grows with the sequence, so each one fits up to a length and no further)."""

from __future__ import annotations

import functools
from collections.abc import Callable

STEP = 1024
"""The lengths tried are multiples of this."""
LIMIT = 1024 * STEP
"""The longest length tried (1M tokens), whatever the model's max_position_embeddings: a longer context than
the model was trained on is what RoPE scaling is for, so the report flags those lengths instead."""


def longest_fitting(fits_at: Callable[[int], dict[str, bool]], limit: int = LIMIT) -> dict[str, int]:
    """For each name `fits_at(seq_len)` answers for, the longest multiple of STEP up to `limit` at which it
    fits; 0 when not even STEP tokens do. Each length is asked once, whichever names need it."""
    probe = functools.cache(fits_at)
    names = probe(STEP)
    return {name: _edge(lambda n, name=name: probe(n * STEP)[name], limit // STEP) for name in names}


def _edge(fits: Callable[[int], bool], most: int) -> int:
    """The largest n in 1..`most` with fits(n), times STEP, for a `fits` true up to some n and false after."""
    if fits(most):
        return most * STEP
    low, high = 0, most  # fits(low) holds (or low is 0), fits(high) does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * STEP
