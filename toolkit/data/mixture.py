"""Which rows go to eval and which (and how often) to training, as indices into the concatenation of all
training sources, and the datasets they select; SFT examples and preference pairs are split alike. Every
draw comes from one seeded generator, so the same seed gives the same split.

Mixture rule: the mixed training set has as many rows as the sources have together (after the eval
hold-out); each source gets the share of that total its weight gives it (largest-remainder rounding).
A source with fewer rows than its share is repeated whole as often as fits, topped up with a random
sample; a larger one is randomly subsampled. The mixture is then shuffled.
"""

from __future__ import annotations

from dataclasses import dataclass

import datasets
import numpy as np

from toolkit.errors import UserError


@dataclass
class Split:
    train: datasets.Dataset
    """The training rows, held out and mixed."""
    eval: datasets.Dataset | None
    """The given eval set, else the rows held out of the sources, else None."""
    train_rows: np.ndarray
    """Each training row's index into the sources one after another."""
    per_source: list[int]
    """Training rows each source contributes."""

    def per_name(self, names: list[str]) -> dict[str, int]:
        """Training rows by source name (a name given twice counts both)."""
        counts: dict[str, int] = {}
        for name, count in zip(names, self.per_source, strict=True):
            counts[name] = counts.get(name, 0) + count
        return counts


def split_sources(
    sources: list[datasets.Dataset],
    held: datasets.Dataset | None,
    eval_fraction: float,
    weights: list[float] | None,
    rng: np.random.Generator,
) -> Split:
    """Train and eval sets from encoded sources: `held` as the eval set when given, else `eval_fraction` of
    the rows held out; the rest mixed by `weights`. Both draws come from `rng`, in that order."""
    sizes = [len(source) for source in sources]
    eval_rows, remaining = hold_out(sizes, 0.0 if held is not None else eval_fraction, rng)
    train_rows = mix(remaining, weights, rng)
    pool = datasets.concatenate_datasets(sources)
    eval_set = pool.select(eval_rows, keep_in_memory=True) if len(eval_rows) else held
    origin = np.repeat(np.arange(len(sources)), sizes)[train_rows]
    per_source = np.bincount(origin, minlength=len(sources)).tolist()
    return Split(pool.select(train_rows, keep_in_memory=True), eval_set, train_rows, per_source)


def hold_out(
    sizes: list[int], fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Draw `fraction` of all rows (at least one, when positive) for eval: (eval indices, each source's
    remaining indices)."""
    total = sum(sizes)
    count = max(1, round(fraction * total)) if fraction > 0 else 0
    if count >= total:
        raise UserError(
            f"data.eval_fraction={fraction} holds out all {total} examples; lower it or set data.eval"
        )
    held = np.zeros(total, dtype=bool)
    held[rng.permutation(total)[:count]] = True
    bounds = np.cumsum([0, *sizes])
    remaining = [lo + np.flatnonzero(~held[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    return np.flatnonzero(held), remaining


def mix(remaining: list[np.ndarray], weights: list[float] | None, rng: np.random.Generator) -> np.ndarray:
    """Training indices: the sources one after another without weights, else the weighted mixture."""
    if weights is None:
        return np.concatenate(remaining)
    counts = shares(sum(len(pool) for pool in remaining), weights)
    picks = []
    for i, (pool, count) in enumerate(zip(remaining, counts, strict=True)):
        if count and not len(pool):
            raise UserError(f"data.train[{i}]: no examples left for training after the eval hold-out")
        repeats, rest = divmod(count, len(pool)) if count else (0, 0)
        picks += [np.tile(pool, repeats), rng.choice(pool, rest, replace=False)]
    mixed = np.concatenate(picks).astype(np.int64)
    return mixed[rng.permutation(len(mixed))]


def shares(total: int, weights: list[float]) -> list[int]:
    """Split `total` in proportion to `weights`, rounding so the parts add up to `total` exactly."""
    w = np.asarray(weights, dtype=np.float64)
    if (w < 0).any() or w.sum() <= 0:
        raise UserError(f"data.weights: {list(weights)} must be non-negative with a positive sum")
    exact = total * w / w.sum()
    counts = np.floor(exact).astype(np.int64)
    leftover = total - int(counts.sum())
    counts[np.argsort(counts - exact, kind="stable")[:leftover]] += 1
    return counts.tolist()
