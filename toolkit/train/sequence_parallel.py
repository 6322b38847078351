"""Ulysses sequence parallelism, the data side: the ranks of one sequence-parallel group train on the same
rows at once, each on one contiguous slice of every sequence. DeepSpeed's attention (swapped in by
accelerate's `prepare`) trades the sequence for heads around each attention call, so attention still sees
whole rows; everything else in the model works on the slice.

Each rank's loader reads rows of its own (accelerate shards them over every process). A step's batches are
shared within the group, and each shared batch becomes one micro-batch that every rank of the group runs,
each on its slice. Labels are shifted before the cut (a slice's last position predicts the first token of
the next slice), position ids follow the slice, and the padding stays at the right end, where causal
attention keeps it out of every real token's view. The loss stays token-exact: each rank sums its slice's
target losses and the step divides by the step's targets over every rank, as without SP.

DeepSpeed also ships a loader adapter that does this sharding; it is not used: its micro-batches cannot be
skipped by loader position on resume, and it drops the labels ftkit's loss and counts read.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from toolkit.data.encode import IGNORE

# How each batch entry is padded when the group's batches are brought to one width for the exchange (the
# padding is cut off again) and when a width is rounded up to a multiple of the group size.
FILL = {"labels": IGNORE}


def unwrapped(loader):
    """The loader accelerate prepared, without the DeepSpeed adapter `prepare` puts around it under SP."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    return loader.dl if isinstance(loader, UlyssesSPDataLoaderAdapter) else loader


class SequenceSplit:
    """Turns this rank's loader batches of one step into the micro-batches its group runs together."""

    def __init__(self, size: int):
        from deepspeed.utils import groups

        self.size = size
        self.group = groups._get_sequence_parallel_group()
        self.rank = dist.get_rank(self.group)

    def step(self, batches: list[dict]) -> list[dict]:
        """The group's batches, in group-rank order, each cut to this rank's slice: `size` micro-batches for
        each of this rank's batches, the same rows on every rank of the group."""
        return [self.cut(shared) for batch in batches for shared in self.shared(batch)]

    def shared(self, batch: dict) -> list[dict]:
        """Every group member's `batch`, in group-rank order (each at its own width)."""
        width = torch.tensor([batch["input_ids"].shape[1]], device=batch["input_ids"].device)
        widths = [torch.zeros_like(width) for _ in range(self.size)]
        dist.all_gather(widths, width, group=self.group)
        widths = [int(w) for w in widths]
        members = [{} for _ in range(self.size)]
        for key, value in batch.items():
            padded = _pad(key, value, max(widths)) if value.dim() > 1 else value  # per-row values stay
            parts = [torch.empty_like(padded) for _ in range(self.size)]
            dist.all_gather(parts, padded.contiguous(), group=self.group)
            for member, part, own in zip(members, parts, widths, strict=True):
                member[key] = part[:, :own] if part.dim() > 1 else part
        return members

    def cut(self, batch: dict) -> dict:
        """This rank's slice of `batch` (whole rows): shifted labels, positions of the slice, real tokens.
        `rows` counts the batch's rows on the group's first rank only, so a step's rows add up once."""
        width = -(-batch["input_ids"].shape[1] // self.size) * self.size
        batch = {key: _pad(key, value, width) if value.dim() > 1 else value for key, value in batch.items()}
        labels = batch.pop("labels")
        batch["shift_labels"] = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)
        batch["position_ids"] = torch.arange(width, device=labels.device).expand(labels.shape[0], -1)
        piece = width // self.size
        here = slice(self.rank * piece, (self.rank + 1) * piece)
        cut = {key: value[:, here] if value.dim() > 1 else value for key, value in batch.items()}
        cut["rows"] = labels.shape[0] if self.rank == 0 else 0
        return cut


def whole_rows(partial: torch.Tensor) -> torch.Tensor:
    """Collective over this rank's sequence-parallel group: per-row sums over its slices (log-probs, token
    counts) added into the whole rows'. The gradient reaches each rank's own slice sum unchanged: every rank
    of the group computes the same loss from the whole rows, and the backend adds the ranks' gradients."""
    from deepspeed.utils import groups

    return _GroupSum.apply(partial, groups._get_sequence_parallel_group())


class _GroupSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _pad(key: str, value: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - value.shape[1]
    if missing == 0:
        return value
    return torch.nn.functional.pad(value, (0, missing), value=FILL.get(key, 0))
