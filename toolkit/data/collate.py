"""Rows to padded batches, and the plain DataLoader that serves them."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from toolkit.loss import IGNORE


class Collator:
    """Right-pads rows to a common length, rounded up to a multiple of `multiple` (tensor cores like
    multiples of 8): input_ids with the pad id, labels with IGNORE, and an attention mask over real tokens.
    A class rather than a closure so DataLoader workers can pickle it."""

    def __init__(self, pad_id: int, multiple: int = 8):
        if pad_id is None:
            raise ValueError("pad_id is None: give the tokenizer a pad token (e.g. its eos token) first")
        self.pad_id = pad_id
        self.multiple = multiple

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(row["input_ids"]) for row in rows)
        width = -(-longest // self.multiple) * self.multiple
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            input_ids[i, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
            labels[i, :n] = torch.as_tensor(row["labels"], dtype=torch.long)
            attention_mask[i, :n] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def build_dataloader(
    dataset, batch_size: int, tokenizer_pad_id: int, shuffle: bool, seed: int, num_workers: int = 0
) -> DataLoader:
    """Batches of `dataset`; when shuffling, the order comes from a generator seeded with `seed` alone."""
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        generator=generator,
        collate_fn=Collator(tokenizer_pad_id),
        num_workers=num_workers,
    )
