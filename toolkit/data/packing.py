"""Less padding: pack whole examples into rows of a fixed token budget, or, without packing, batch examples
of similar length together.

A packed row is several examples one after another. Each example keeps its own positions (`position_ids`
restart at 0), which is what the model's attention uses to keep every token within its own example, and
the first label of every example is ignored, because the next-token shift would otherwise predict it from
the previous example's last token. The loss of a packed row is then the sum of its examples' losses alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from toolkit.data.encode import IGNORE
from toolkit.train.batches import EpochSampler

# Global batches whose examples are sorted by length together: larger groups pad less, smaller ones keep
# each step's mix of lengths closer to a random draw.
GROUP_STEPS = 16
# Rows whose lengths are read at once.
LENGTHS_BATCH = 65536


def fill_rows(lengths: np.ndarray, capacity: int, rng: np.random.Generator) -> list[list[int]]:
    """Indices into `lengths` grouped into rows of at most `capacity` tokens. Each row takes the longest
    example left, then the subset of the others that fills it best (minimum bin slack): unlike best-fit
    decreasing it keeps rows full when every example is a large share of a row. Which of several equally
    long examples goes where is drawn from `rng`."""
    if len(lengths) and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"example lengths must be in [1, {capacity}], got {lengths.min()}..{lengths.max()}")
    queues: dict[int, list[int]] = {}
    for i in rng.permutation(len(lengths)).tolist():
        queues.setdefault(int(lengths[i]), []).append(i)
    rows = []
    while queues:
        longest = max(queues)
        row = [_pop(queues, longest)]
        row += [_pop(queues, n) for n in _best_fill(queues, capacity - longest)]
        rows.append(row)
    return rows


def _pop(queues: dict[int, list[int]], length: int) -> int:
    index = queues[length].pop()
    if not queues[length]:
        del queues[length]
    return index


def _best_fill(queues: dict[int, list[int]], room: int) -> list[int]:
    """Lengths (with repeats) of the examples left whose sum comes closest to `room` without passing it.

    A subset sum over a Python int used as a bitset: bit s of `reach` says some subset sums to s, so adding
    an example is one shift-or. Each length's count is split into powers of two, so a length seen a
    thousand times costs ten steps, not a thousand."""
    if room <= 0:
        return []
    mask, reach, steps = (1 << (room + 1)) - 1, 1, []
    for length in sorted((n for n in queues if n <= room), reverse=True):
        left, chunk = min(len(queues[length]), room // length), 1
        while left:
            count = min(chunk, left)
            steps.append((length, count, reach))
            reach = (reach | reach << length * count) & mask
            left, chunk = left - count, chunk * 2
        if reach >> room & 1:
            break
    total, chosen = reach.bit_length() - 1, []
    for length, count, before in reversed(steps):
        if not before >> total & 1:
            chosen += [length] * count
            total -= length * count
    return chosen


def pack_dataset(
    dataset: datasets.Dataset, capacity: int, rng: np.random.Generator
) -> tuple[PackedRows, float]:
    """(packed rows, packing efficiency): every example of `dataset` exactly once, whole, in rows of at
    most `capacity` tokens with `input_ids`, `labels` and `position_ids`; efficiency is the share of the
    rows' `capacity` tokens that are real. Planned from the examples' lengths alone; a row's tokens are
    read from `dataset` (memory-mapped) when the row is used."""
    lengths = row_lengths(dataset)
    rows = fill_rows(lengths, capacity, rng)
    order = np.fromiter((i for row in rows for i in row), dtype=np.int64, count=len(lengths))
    bounds = np.cumsum([0, *map(len, rows)], dtype=np.int64)
    efficiency = float(lengths.sum()) / max(len(rows) * capacity, 1)
    return PackedRows(dataset, order, bounds, np.add.reduceat(lengths[order], bounds[:-1])), efficiency


class PackedRows(torch.utils.data.Dataset):
    """Packed rows as a view of the examples: row r is examples order[bounds[r]:bounds[r + 1]] of
    `examples`, one after another. Indexing by a column name lists that column of every row."""

    def __init__(
        self, examples: datasets.Dataset, order: np.ndarray, bounds: np.ndarray, lengths: np.ndarray
    ):
        self.examples = examples.with_format("arrow")
        self.order = order
        self.bounds = bounds
        self.lengths = lengths if len(order) else np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, key):
        if isinstance(key, str):
            return [self[i][key] for i in range(len(self))]
        picked = self.examples[self.order[self.bounds[key] : self.bounds[key + 1]].tolist()]
        sizes = pc.list_value_length(picked["input_ids"]).to_numpy(zero_copy_only=False).astype(np.int64)
        positions = np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        labels = _flat(picked["labels"])
        labels[positions == 0] = IGNORE
        return {
            "input_ids": _flat(picked["input_ids"]).tolist(),
            "labels": labels.tolist(),
            "position_ids": positions.tolist(),
        }

    def __iter__(self) -> Iterator[dict]:
        return (self[i] for i in range(len(self)))


def _flat(column: pa.ChunkedArray) -> np.ndarray:
    return pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.int64)


def row_lengths(dataset: datasets.Dataset, column: str = "input_ids") -> np.ndarray:
    """Tokens in each row of `dataset` (examples or packed rows), in its token-list `column`, from the row
    offsets alone."""
    if isinstance(dataset, PackedRows):
        return dataset.lengths
    # A batch at a time: a dataset that selects rows would otherwise copy every token to list them.
    lengths = [
        pc.list_value_length(batch[column]).to_numpy(zero_copy_only=False).astype(np.int64)
        for batch in dataset.with_format("arrow").iter(batch_size=LENGTHS_BATCH)
    ]
    return np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)


def group_by_length(
    order: np.ndarray, lengths: np.ndarray, batch_size: int, rng: np.random.Generator
) -> np.ndarray:
    """`order` (a whole number of batches) rearranged so each batch holds examples of similar length:
    groups of GROUP_STEPS batches are sorted by length and cut into batches, whose order is then shuffled,
    except that the batch holding the longest example goes first (too large a batch fails at once)."""
    groups = [order[i : i + GROUP_STEPS * batch_size] for i in range(0, len(order), GROUP_STEPS * batch_size)]
    ordered = np.concatenate([g[np.argsort(-lengths[g], kind="stable")] for g in groups])
    batches = ordered.reshape(-1, batch_size)[rng.permutation(len(ordered) // batch_size)]
    longest = int(np.argmax(lengths[batches].max(axis=1)))
    batches[[0, longest]] = batches[[longest, 0]]
    return batches.reshape(-1)


class LengthGroupedSampler(EpochSampler):
    """EpochSampler's examples for each epoch (the same whole global batches' worth), each global batch
    drawn from examples of similar length, so micro-batches pad little. Like EpochSampler it depends on
    (seed, epoch) alone, which keeps ranks and resumed runs in step."""

    def __init__(self, lengths: np.ndarray, global_batch_size: int, seed: int):
        super().__init__(len(lengths), global_batch_size, seed)
        self.lengths = np.asarray(lengths)
        self.global_batch_size = global_batch_size

    def __iter__(self) -> Iterator[int]:
        order = np.fromiter(super().__iter__(), dtype=np.int64, count=self.usable)
        rng = np.random.default_rng((self.seed, self.epoch))
        return iter(group_by_length(order, self.lengths, self.global_batch_size, rng).tolist())
