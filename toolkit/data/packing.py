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

from toolkit.batches import EpochSampler
from toolkit.data.encode import IGNORE

# Global batches whose examples are sorted by length together: larger groups pad less, smaller ones keep
# each step's mix of lengths closer to a random draw.
GROUP_STEPS = 16


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
) -> tuple[datasets.Dataset, float]:
    """(packed rows, packing efficiency): every example of `dataset` exactly once, whole, in rows of at
    most `capacity` tokens with `input_ids`, `labels` and `position_ids`; efficiency is the share of the
    rows' `capacity` tokens that are real."""
    table = dataset.with_format("arrow")[:]
    lengths = pc.list_value_length(table["input_ids"]).to_numpy(zero_copy_only=False).astype(np.int64)
    rows = fill_rows(lengths, capacity, rng)
    order = np.asarray([i for row in rows for i in row], dtype=np.int64)
    tokens, positions = _token_order(lengths, order)
    ids = _flat(table["input_ids"])[tokens]
    labels = _flat(table["labels"])[tokens]
    labels[positions == 0] = IGNORE
    row_ends = np.cumsum([lengths[row].sum() for row in rows], dtype=np.int64)
    offsets = pa.array(np.concatenate([[0], row_ends]).astype(np.int32))
    columns = {
        name: pa.ListArray.from_arrays(offsets, pa.array(values.astype(np.int32)))
        for name, values in (("input_ids", ids), ("labels", labels), ("position_ids", positions))
    }
    efficiency = float(lengths.sum()) / max(len(rows) * capacity, 1)
    return datasets.Dataset.from_dict(columns), efficiency


def _token_order(lengths: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index of each token in the flattened examples, its position within its example) when the
    examples are laid out in `order`."""
    sizes = lengths[order]
    starts = np.cumsum(lengths) - lengths
    first = np.repeat(np.cumsum(sizes) - sizes, sizes)
    positions = np.arange(int(sizes.sum()), dtype=np.int64) - first
    return np.repeat(starts[order], sizes) + positions, positions


def _flat(column: pa.ChunkedArray) -> np.ndarray:
    return pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.int64)


def row_lengths(dataset: datasets.Dataset) -> np.ndarray:
    """Tokens in each row of `dataset`."""
    column = dataset.with_format("arrow")["input_ids"]
    return pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)


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
