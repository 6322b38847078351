"""Streaming (`data.streaming`): for corpora larger than RAM or the disk cache. Records are read, encoded
and packed into rows of `max_length` tokens while training runs; nothing is encoded ahead or cached.

Each process reads its own chunks of records (chunk c goes to process c mod world size), so no two
processes train on the same example, and packs them greedily in file order, whole examples one after
another (the next row starts where one no longer fits). A packed row is therefore fixed by where its first
example is, and so is everything after it: that position, noted every few rows, is all it takes to go
back to any row. Rows are numbered by the step-shaped batch order, so the row a resumed run needs follows
from the step alone; the positions noted under the datasets cache make reaching it quick, and without them
the stream is replayed from its start, with the same result. The corpus repeats (in the same order)
once every process has read its share."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from toolkit.data.cache import cache_root
from toolkit.data.encode import IGNORE, ChunkEncoder
from toolkit.data.sources import Source
from toolkit.errors import UserError

# Every NOTE_EVERY-th row of a process's stream has its position noted (in memory and on disk).
NOTE_EVERY = 64


@dataclass(frozen=True)
class Position:
    """Where a packed row's first example is: the pass over the corpus, the chunk, the example in it."""

    epoch: int
    chunk: int
    offset: int


def rank_and_world() -> tuple[int, int]:
    """This process's place in the process group the loader runs under (as torch's DistributedSampler
    reads it), or (0, 1) without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class StreamRows(torch.utils.data.Dataset):
    """Packed rows read on the fly, as a map-style dataset over sequential per-process streams: row i is
    in micro-batch i // micro_batch_size, which the step-shaped batch order gives to process
    (i // micro_batch_size) mod world size; that process serves it as row j of its own stream. Rows must
    be asked for in order (no loader worker processes)."""

    def __init__(
        self, sources: list[tuple[Source, ChunkEncoder]], chunk_size: int, max_length: int, key: str
    ):
        self.sources = sources
        self.chunk_size = chunk_size
        self.max_length = max_length
        self.key = key
        self.micro_batch_size = 1
        self._next_row: int | None = None
        self._rows: Iterator | None = None
        self._noted: dict[int, Position] = {}

    def __len__(self) -> int:
        return np.iinfo(np.int64).max

    def __getitem__(self, i: int) -> dict:
        rank, world = rank_and_world()
        batch = i // self.micro_batch_size
        if batch % world != rank:
            raise RuntimeError(f"row {i} belongs to process {batch % world}, asked on process {rank}")
        j = batch // world * self.micro_batch_size + i % self.micro_batch_size
        if j != self._next_row:
            self._rows = self._open(j, rank, world)
        position, row = next(self._rows)
        if j % NOTE_EVERY == 0:
            self._note(j, position, rank, world)
        self._next_row = j + 1
        return row

    def _open(self, j: int, rank: int, world: int) -> Iterator:
        """This process's rows from its row j on: from the nearest noted position at or before j."""
        self._noted.update(self._read_notes(rank, world))
        start = max((k for k in self._noted if k <= j), default=0)
        rows = self.rows(self._noted.get(start, Position(0, 0, 0)), rank, world)
        for _ in range(j - start):
            next(rows)
        return rows

    def rows(self, start: Position, rank: int, world: int) -> Iterator[tuple[Position, dict]]:
        """(position, packed row) of process `rank`'s stream from `start` on, without end."""
        row, used, first = [], 0, start
        for position, ids, labels in self.examples(start, rank, world):
            if row and used + len(ids) > self.max_length:
                yield first, _join(row)
                row, used = [], 0
            if not row:
                first = position
            row.append((ids, labels))
            used += len(ids)

    def examples(self, start: Position, rank: int, world: int) -> Iterator[tuple[Position, list, list]]:
        """(position, input ids, labels) of every example of this process's chunks, pass after pass."""
        epoch = start.epoch
        while True:
            found = False
            for c, chunk, encode in self._chunks():
                if c % world != rank or (epoch == start.epoch and c < start.chunk):
                    continue
                columns, _ = encode(chunk)
                skip = start.offset if (epoch, c) == (start.epoch, start.chunk) else 0
                for k, (ids, labels) in enumerate(zip(columns["input_ids"], columns["labels"], strict=True)):
                    if k >= skip:
                        found = True
                        yield Position(epoch, c, k), ids, labels
            if not found and epoch > start.epoch:
                raise UserError(
                    f"data.streaming: process {rank} of {world} got no example with a trained token; "
                    "the training data has too few records (or chunks) for this many processes"
                )
            epoch += 1

    def _chunks(self):
        c = 0
        for source, encode in self.sources:
            for chunk in source.read(self.chunk_size):
                yield c, chunk, encode
                c += 1

    def _notes_path(self, rank: int, world: int) -> Path:
        return cache_root() / "streams" / f"{self.key}-{rank}-of-{world}.jsonl"

    def _read_notes(self, rank: int, world: int) -> dict[int, Position]:
        path = self._notes_path(rank, world)
        if not path.is_file():
            return {}
        notes = {}
        for line in path.read_text().splitlines():
            try:
                row, epoch, chunk, offset = json.loads(line)
            except ValueError:  # a line cut short by a crash: the others still hold
                continue
            notes[row] = Position(epoch, chunk, offset)
        return notes

    def _note(self, j: int, position: Position, rank: int, world: int) -> None:
        if j in self._noted:
            return
        self._noted[j] = position
        path = self._notes_path(rank, world)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as handle:
            handle.write(json.dumps([j, position.epoch, position.chunk, position.offset]) + "\n")


def _join(examples: list[tuple[list, list]]) -> dict:
    """One packed row; every example restarts its positions and its first label is not a target (see
    toolkit/data/packing.py)."""
    ids, labels, positions = [], [], []
    for example_ids, example_labels in examples:
        ids += example_ids
        labels += [IGNORE, *example_labels[1:]]
        positions += range(len(example_ids))
    return {"input_ids": ids, "labels": labels, "position_ids": positions}
