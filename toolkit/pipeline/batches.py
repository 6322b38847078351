"""A step's micro-batches as the pipeline takes them: one tensor per input, every micro-batch padded to
the same rows and width. A schedule's stages size their send and receive buffers at the first step and
check every later micro-batch against them, so the shape never changes within a run.

The padding changes no loss: padded tokens carry no label, and real tokens never attend to them (right
padding of a causal model; in packed rows the padding gets position ids of its own, as the collator does).
"""

from __future__ import annotations

import torch

from toolkit.data.encode import IGNORE

ROUND = 8


def pipeline_width(max_length: int) -> int:
    """The fixed sequence length of every micro-batch: data.max_length rounded up as the collator rounds."""
    return -(-max_length // ROUND) * ROUND


def padded(batch: dict, rows: int, width: int, pad_id: int) -> tuple[torch.Tensor, ...]:
    """(input_ids, position_ids, attention_mask, labels) of one micro-batch at [rows, width]. Packed rows
    (with position ids) get an all-ones mask: the stages then separate their examples by position."""
    ids, labels = batch["input_ids"], batch["labels"]
    n, length = ids.shape
    if length > width or n > rows:
        raise ValueError(f"a micro-batch of {n} x {length} exceeds the pipeline's {rows} x {width}")
    packed = "position_ids" in batch
    out_ids = torch.full((rows, width), pad_id, dtype=ids.dtype, device=ids.device)
    out_labels = torch.full_like(out_ids, IGNORE)
    attention = torch.ones_like(out_ids) if packed else torch.zeros_like(out_ids)
    positions = torch.arange(width, device=ids.device).repeat(rows, 1)
    out_ids[:n, :length], out_labels[:n, :length] = ids, labels
    if packed:
        positions[:n, :length] = batch["position_ids"]
        positions[:n, length:] = torch.arange(width - length, device=ids.device)
    else:
        attention[:n, :length] = batch["attention_mask"]
        attention[n:] = 1  # rows added to fill the micro-batch: padding that attends to itself, no labels
    return out_ids, positions, attention, out_labels


def stacked(micro_batches: list[dict], rows: int, width: int, pad_id: int) -> tuple[torch.Tensor, ...]:
    """The step's micro-batches, each `padded`, concatenated along the rows in order (the schedule cuts
    them apart again, micro-batch i being rows [i * rows, (i + 1) * rows))."""
    parts = [padded(batch, rows, width, pad_id) for batch in micro_batches]
    return tuple(torch.cat(column) for column in zip(*parts))
