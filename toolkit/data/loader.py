"""The DataLoaders: training (examples or packed rows in step-shaped order, see toolkit/train/batches.py) and
evaluation (each rank a strided share of the held-out rows)."""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader, Dataset

from toolkit.config import DataConfig, TrainConfig
from toolkit.data.collate import Collator, PackedCollator
from toolkit.data.encode import IGNORE
from toolkit.data.packing import LengthGroupedSampler, row_lengths
from toolkit.data.parallel import default_signals
from toolkit.data.streaming import StreamRows
from toolkit.errors import UserError
from toolkit.train.batches import EpochSampler


def train_loader(
    dataset,
    data: DataConfig,
    train: TrainConfig,
    pad_id: int,
    seed: int,
    flash_varlen: bool,
    collate=None,
    lengths=None,
):
    """(loader, sampler): micro-batches of `dataset` whose order depends on (seed, epoch) alone; `collate`
    replaces the SFT collators and `lengths` (tokens per row, for data.group_by_length) the SFT row
    lengths (e.g. for preference pairs)."""
    if data.streaming:
        return _stream_loader(dataset, data, train, pad_id, flash_varlen)
    if data.group_by_length:
        lengths = row_lengths(dataset) if lengths is None else lengths
        sampler = LengthGroupedSampler(lengths, train.global_batch_size, seed)
    else:
        sampler = EpochSampler(len(dataset), train.global_batch_size, seed)
    if collate is None:
        collate = PackedCollator(pad_id, flash_varlen=flash_varlen) if data.packing else Collator(pad_id)
    loader = DataLoader(
        dataset,
        batch_size=train.micro_batch_size,
        sampler=sampler,
        collate_fn=collate,
        num_workers=data.num_workers,
        # Page-locked batches copy to the GPU asynchronously; workers stay alive across epochs.
        pin_memory=torch.cuda.is_available(),
        persistent_workers=data.num_workers > 0,
        worker_init_fn=_start_worker,
        drop_last=True,
    )
    return loader, sampler


def _start_worker(worker_id: int) -> None:
    """A loader worker leaves stopping to the training process (see toolkit/data/parallel.py)."""
    default_signals()


def _stream_loader(rows: StreamRows, data: DataConfig, train: TrainConfig, pad_id: int, flash_varlen: bool):
    """Packed rows in their stream order: row numbers 0, 1, ... for exactly max_steps steps, which the
    step-shaped batch order deals out to the processes micro-batch by micro-batch."""
    if data.num_workers or data.group_by_length:
        raise UserError(
            "data.streaming reads rows in order in the training process: set data.num_workers: 0 and "
            "data.group_by_length: false"
        )
    rows.micro_batch_size = train.micro_batch_size  # how row numbers map to each process's stream
    sampler = EpochSampler(
        train.max_steps * train.global_batch_size, train.global_batch_size, 0, shuffle=False
    )
    loader = DataLoader(
        rows,
        batch_size=train.micro_batch_size,
        sampler=sampler,
        collate_fn=PackedCollator(pad_id, flash_varlen=flash_varlen),
        pin_memory=torch.cuda.is_available(),
        drop_last=True,
    )
    return loader, sampler


def eval_loader(
    dataset, rank: int, world_size: int, batch_size: int, pad_id: int, collate=None
) -> DataLoader:
    """Rank `rank`'s share of the held-out `dataset`, padded batches in a fixed order (by `collate`, else
    the SFT collator)."""
    return DataLoader(
        RankShard(dataset, rank, world_size), batch_size=batch_size, collate_fn=collate or Collator(pad_id)
    )


class RankShard(Dataset):
    """Rank `rank`'s strided share of `dataset`, topped up with label-free copies of the first row so that
    every rank runs the same number of forward passes (sharded backends need them in lockstep) while
    the extra rows add nothing to the loss."""

    def __init__(self, dataset, rank: int, world_size: int):
        self.dataset = dataset
        self.indices = list(range(rank, len(dataset), world_size))
        self.length = math.ceil(len(dataset) / world_size)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        if i < len(self.indices):
            return self.dataset[self.indices[i]]
        row = self.dataset[0]
        return {**row, "labels": [IGNORE] * len(row["labels"])}
