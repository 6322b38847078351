"""Rows to padded batches, and the plain DataLoader that serves them."""

from __future__ import annotations

import torch

from toolkit.data.encode import IGNORE


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


class PackedCollator(Collator):
    """Pads packed rows (`data.packing`) like `Collator` and adds their `position_ids`; the padding gets
    positions of its own (0, 1, ...) so it joins no example. Instead of an attention mask it emits
    `token_mask` (real tokens, for counting): the model keeps each example's attention to itself only
    when it gets position_ids and no attention_mask. With `flash_varlen`, also the sequence boundaries
    FlashAttention-2 needs to do the same for more than one row per batch."""

    def __init__(self, pad_id: int, multiple: int = 8, flash_varlen: bool = False):
        super().__init__(pad_id, multiple)
        self.flash_varlen = flash_varlen

    def __call__(self, rows: list[dict]) -> dict:
        batch = super().__call__(rows)
        batch["token_mask"] = batch.pop("attention_mask")
        width = batch["input_ids"].shape[1]
        positions = [torch.as_tensor(row["position_ids"], dtype=torch.long) for row in rows]
        batch["position_ids"] = torch.stack([torch.cat([p, torch.arange(width - len(p))]) for p in positions])
        if self.flash_varlen:
            batch.update(flash_varlen_kwargs(batch["position_ids"]))
        return batch


def flash_varlen_kwargs(position_ids: torch.Tensor) -> dict:
    """Cumulative sequence lengths over the flattened batch, in the keys transformers' FlashAttention
    integration reads; without them it separates packed examples only in a batch of one row."""
    flat = position_ids.reshape(-1)
    starts = torch.cat([torch.nonzero(flat == 0).reshape(-1), torch.tensor([flat.numel()])]).to(torch.int32)
    longest = int(starts.diff().max())
    return {
        "cu_seq_lens_q": starts,
        "cu_seq_lens_k": starts,
        "max_length_q": longest,
        "max_length_k": longest,
    }


# The batch entries a causal LM's forward takes; labels and token_mask are for the loss and the counts.
MODEL_KEYS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    # A vision-language model's image inputs (toolkit/data/vision_rows.py), as its processor names them.
    "pixel_values",
    "pixel_attention_mask",
    "image_sizes",
    "image_grid_thw",
    "image_position_ids",
    "token_type_ids",
    "mm_token_type_ids",
)


def model_inputs(batch: dict) -> dict:
    """Keyword arguments for the model's forward from a batch of either collator. The cache stays off: with
    one, transformers would ignore that position_ids restart and let packed examples attend to each other."""
    return {"use_cache": False, **{key: batch[key] for key in MODEL_KEYS if key in batch}}


def real_tokens(batch: dict) -> torch.Tensor:
    """The mask of real (not padding) tokens of a batch of either collator."""
    return batch["token_mask" if "token_mask" in batch else "attention_mask"]


def count_rows(batch: dict) -> int:
    """Rows in a batch; a sequence-parallel slice says how many of its rows to count (see
    toolkit/train/sequence_parallel.py)."""
    return batch.get("rows", len(batch["input_ids"]))


def count_tokens(batch: dict) -> int:
    """Real (not padding) tokens in a batch of either collator."""
    return int(real_tokens(batch).sum())
