"""The Bradley-Terry loss of a reward model on stacked pairs (the B chosen rows, then the B rejected).

Each pair's loss is -log sigmoid(r_chosen - r_rejected - margin), plus reward.center_coefficient x
(r_chosen + r_rejected)^2; a step's loss is their mean over every pair of the global batch (the recipe
scales each micro-batch's sum by the global pair count: `toolkit.train.loss.backward_scale`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toolkit.data.collate import model_inputs
from toolkit.distributed import sum_over_data
from toolkit.reward.config import RewardConfig


def batch_rewards(model, batch: dict) -> torch.Tensor:
    """One reward per row of `batch` (float32 at least): the scalar head on each row's last real token."""
    scores = model(**model_inputs(batch)).logits.squeeze(-1)
    return scores.to(torch.promote_types(scores.dtype, torch.float32))


@dataclass
class RewardTerms:
    losses: torch.Tensor
    """Per-pair loss (to be averaged over the pairs of the global batch)."""
    chosen: torch.Tensor
    rejected: torch.Tensor


def reward_terms(cfg: RewardConfig, rewards: torch.Tensor, margin: torch.Tensor) -> RewardTerms:
    """Losses of a stacked batch's pairs from its rows' `rewards` and each pair's `margin`."""
    chosen, rejected = rewards.chunk(2)
    losses = -F.logsigmoid(chosen - rejected - margin.to(chosen))
    if cfg.center_coefficient:
        losses = losses + cfg.center_coefficient * (chosen + rejected) ** 2
    return RewardTerms(losses, chosen.detach(), rejected.detach())


# Per-pair means logged beside the loss, in the order metrics.jsonl has them.
MEANS = ("reward_accuracy", "reward_margin", "rewards_chosen", "rewards_rejected")
SUMS = ("loss", *MEANS, "pairs")


class RewardSums:
    """Named float64 sums over pairs (a step's, or the eval set's), kept on `device` until `reduce` adds
    them over ranks; `metrics` gives their per-pair means."""

    def __init__(self, device=None):
        self.sums = torch.zeros(len(SUMS), dtype=torch.float64, device=device)

    def add(self, terms: RewardTerms, keep=None) -> None:
        """Add a micro-batch's pairs; `keep` (one flag per pair) leaves out padding copies."""
        chosen, rejected = terms.chosen.double(), terms.rejected.double()
        per_pair = [terms.losses.detach().double(), chosen > rejected, chosen - rejected, chosen, rejected]
        weight = torch.ones_like(chosen) if keep is None else torch.as_tensor(keep).to(chosen)
        values = [(value.double() * weight).sum() for value in per_pair] + [weight.sum()]
        self.sums += torch.stack(values)

    def reduce(self, accelerator) -> RewardSums:
        """Collective: the sums added over every rank in one reduction, in place; returns self."""
        self.sums = sum_over_data(accelerator, self.sums)
        return self

    def metrics(self, prefix: str = "") -> dict[str, float]:
        sums = dict(zip(SUMS, self.sums.tolist(), strict=True))
        pairs = max(sums.pop("pairs"), 1)
        return {f"{prefix}{name}": value / pairs for name, value in sums.items()}
