"""Preference losses on per-sequence log-probabilities.

Each pair's completion log-probability is the sum over its completion tokens (padding and prompt never
count). A step's loss is the mean of the per-pair losses over every pair of the global batch, plus, for
ORPO or with dpo.sft_weight, the NLL of the chosen completions per chosen token of the global batch; the
recipe scales each micro-batch's sums by those global counts (see `toolkit.loss.backward_scale`), so the
split into micro-batches and processes does not change the gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toolkit.loss import IGNORE
from toolkit.preference.config import DpoConfig


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of each row's label tokens, number of those tokens) after the shift; computed in
    float32 at least."""
    targets = labels[:, 1:]
    logits = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))
    nll = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")
    return -nll.sum(dim=1), (targets != IGNORE).sum(dim=1)


@dataclass
class PairTerms:
    losses: torch.Tensor
    """Per-pair preference loss (to be averaged over the pairs of the global batch)."""
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    nll_sum: torch.Tensor
    """Summed NLL of the chosen completion tokens (ORPO's second term, or dpo.sft_weight's; else zero)."""


def pair_terms(
    cfg: DpoConfig, logps: torch.Tensor, counts: torch.Tensor, ref_logps: torch.Tensor | None = None
) -> PairTerms:
    """Losses and implicit rewards of a stacked batch: `logps`/`counts` (and `ref_logps` for losses with a
    reference) hold the B chosen rows first, then the B rejected rows."""
    chosen, rejected = logps.chunk(2)
    n_chosen, n_rejected = counts.clamp(min=1).chunk(2)
    beta = cfg.beta
    if cfg.loss in ("sigmoid", "ipo"):
        ref_chosen, ref_rejected = ref_logps.chunk(2)
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        rewards = beta * chosen_ratio, beta * rejected_ratio
        if cfg.loss == "sigmoid":
            losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
        else:
            # Per-token log-ratios keep IPO's squared target 1/(2 beta) meaningful whatever the lengths.
            delta = chosen_ratio / n_chosen - rejected_ratio / n_rejected
            losses = (delta - 1 / (2 * beta)) ** 2
    else:
        mean_chosen, mean_rejected = chosen / n_chosen, rejected / n_rejected
        rewards = beta * mean_chosen, beta * mean_rejected
        if cfg.loss == "simpo":
            losses = -F.logsigmoid(beta * (mean_chosen - mean_rejected) - cfg.simpo_gamma)
        else:
            log_odds = (mean_chosen - mean_rejected) - (_log1mexp(mean_chosen) - _log1mexp(mean_rejected))
            losses = -beta * F.logsigmoid(log_odds)
    nll = -nll_weight(cfg) * chosen.sum()
    return PairTerms(losses, rewards[0].detach(), rewards[1].detach(), nll)


def nll_weight(cfg: DpoConfig) -> float:
    """Weight of the chosen completions' NLL in the loss: dpo.sft_weight, unset meaning ORPO's 1 for orpo
    and 0 for the others."""
    if cfg.sft_weight is not None:
        return cfg.sft_weight
    return 1.0 if cfg.loss == "orpo" else 0.0


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, by the branch that does not cancel."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def micro_objective(terms: PairTerms, pair_scale: float, token_scale: float) -> torch.Tensor:
    """What one micro-batch back-propagates: its sums, scaled by the step's global pair and chosen-token
    counts (`toolkit.loss.backward_scale`)."""
    return terms.losses.sum() * pair_scale + terms.nll_sum * token_scale


def pair_stats(terms: PairTerms, logps: torch.Tensor) -> torch.Tensor:
    """Sums over this micro-batch's pairs, in METRIC_NAMES order, for a step's metrics."""
    chosen, rejected = logps.detach().chunk(2)
    margin = terms.chosen_rewards - terms.rejected_rewards
    return torch.stack(
        [
            terms.losses.detach().sum(),
            terms.nll_sum.detach(),
            terms.chosen_rewards.sum(),
            terms.rejected_rewards.sum(),
            (margin > 0).float().sum(),
            margin.sum(),
            chosen.sum(),
            rejected.sum(),
        ]
    ).double()


METRIC_NAMES = (
    "rewards_chosen",
    "rewards_rejected",
    "reward_accuracy",
    "reward_margin",
    "logps_chosen",
    "logps_rejected",
)


def step_metrics(sums: list[float], pairs: int, chosen_tokens: int, prefix: str = "") -> dict:
    """The step's loss and per-pair means from `pair_stats` sums reduced over micro-batches and ranks."""
    loss = sums[0] / max(pairs, 1) + sums[1] / max(chosen_tokens, 1)
    means = {f"{prefix}{name}": value / max(pairs, 1) for name, value in zip(METRIC_NAMES, sums[2:])}
    return {f"{prefix}loss": loss, **means}
