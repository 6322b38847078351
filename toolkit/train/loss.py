"""Token-exact loss: one optimizer step's loss is the mean over every label token of every micro-batch
on every rank, however the global batch is split into micro-batches and processes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toolkit.data.collate import model_inputs
from toolkit.data.encode import IGNORE
from toolkit.train import head


def count_targets(labels: torch.Tensor) -> int:
    """Label tokens that contribute to the loss (after the next-token shift)."""
    return int((labels[:, 1:] != IGNORE).sum())


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over label tokens, computed in float32."""
    logits = logits[:, :-1].float()
    targets = labels[:, 1:]
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )


def batch_targets(batch: dict) -> int:
    """Label tokens of `batch` that contribute to the loss: its `labels` after the next-token shift, or
    its `shift_labels` (a sequence-parallel slice's, shifted before the cut)."""
    if "shift_labels" in batch:
        return int((batch["shift_labels"] != IGNORE).sum())
    return count_targets(batch["labels"])


def batch_loss(model, batch: dict) -> torch.Tensor:
    """`summed_token_loss` of `model` on `batch`, through the chunked head when the model has one."""
    if head.chunked_head(model) is not None:
        return -head.target_logps(model, batch, uniform=True).sum()
    logits = model(**model_inputs(batch)).logits
    if "shift_labels" in batch:  # every position of a sequence-parallel slice has its target already
        targets = batch["shift_labels"]
        return F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)),
            targets.reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )
    return summed_token_loss(logits, batch["labels"])


def summed_logps_loss(logps: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`summed_token_loss` from per-position target log-probs (a pipeline's last stage gives those)."""
    return -logps.sum()


def backward_scale(step_targets: int, grad_accum_steps: int, world_size: int) -> float:
    """Factor for each micro-batch's summed loss so that the gradients the backend produces equal the
    gradient of (sum of token losses in the step / tokens in the step).

    Every backend divides the loss by the accumulation steps and averages gradients over ranks, so
    both are multiplied back here.
    """
    return grad_accum_steps * world_size / max(step_targets, 1)
