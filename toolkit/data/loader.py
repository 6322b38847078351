"""The training DataLoader: examples or packed rows in step-shaped order (see toolkit/batches.py)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from toolkit.batches import EpochSampler
from toolkit.config import DataConfig, TrainConfig
from toolkit.data.collate import Collator, PackedCollator
from toolkit.data.packing import LengthGroupedSampler, row_lengths


def train_loader(
    dataset, data: DataConfig, train: TrainConfig, pad_id: int, seed: int, flash_varlen: bool, collate=None
):
    """(loader, sampler): micro-batches of `dataset` whose order depends on (seed, epoch) alone; `collate`
    replaces the SFT collators (e.g. for preference pairs)."""
    if data.group_by_length:
        sampler = LengthGroupedSampler(row_lengths(dataset), train.global_batch_size, seed)
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
        drop_last=True,
    )
    return loader, sampler
