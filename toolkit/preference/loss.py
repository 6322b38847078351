"""Preference losses on per-sequence log-probabilities.

Each pair's completion log-probability is the sum over its completion tokens (padding and prompt never
count). A step's loss is the mean of the per-pair losses over every pair of the global batch, plus, for
ORPO or with dpo.sft_weight, the NLL of the chosen completions per chosen token of the global batch; the
recipe scales each micro-batch's sums by those global counts (see `toolkit.train.loss.backward_scale`), so the
split into micro-batches and processes does not change the gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toolkit.data.collate import model_inputs
from toolkit.distributed import sum_over_data
from toolkit.preference.config import DpoConfig
from toolkit.train import head, sequence_parallel
from toolkit.train.loss import IGNORE


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of each row's label tokens, number of those tokens) after the shift; computed in
    float32 at least."""
    targets = labels[:, 1:]
    logits = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))
    nll = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")
    return -nll.sum(dim=1), (targets != IGNORE).sum(dim=1)


def batch_sequence_logps(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logps` of `model` on `batch`, through the chunked head when the model has one. A
    sequence-parallel slice (its `shift_labels` shifted before the cut) gives its rows' partial sums, added
    over its group into the whole rows'."""
    if "shift_labels" in batch:
        return _whole_rows_logps(model, batch)
    if head.chunked_head(model) is None:
        return sequence_logps(model(**model_inputs(batch)).logits, batch["labels"])
    return head.target_logps(model, batch).sum(dim=1), target_counts(batch["labels"])


def _whole_rows_logps(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    # DeepSpeed's Ulysses attention is built for the loader's micro-batch of rows (its pairs): the chosen and
    # the rejected rows run as two forward passes.
    keys = ("input_ids", "attention_mask", "position_ids", "shift_labels")
    halves = [{key: batch[key].chunk(2)[side] for key in keys if key in batch} for side in (0, 1)]
    partial = torch.cat([_slice_logps(model, half) for half in halves])
    counts = (batch["shift_labels"] != IGNORE).sum(dim=1)
    return sequence_parallel.whole_rows(partial), sequence_parallel.whole_rows(counts)


def _slice_logps(model, batch: dict) -> torch.Tensor:
    """Per-row summed log-probs of a sequence-parallel slice's targets."""
    if head.chunked_head(model) is not None:
        return head.target_logps(model, batch).sum(dim=1)
    logits = model(**model_inputs(batch)).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    nll = F.cross_entropy(
        logits.transpose(1, 2), batch["shift_labels"], ignore_index=IGNORE, reduction="none"
    )
    return -nll.sum(dim=1)


def chosen_targets(batch: dict) -> int:
    """Label tokens of a stacked batch's chosen rows (the first half) that the NLL term counts."""
    if "shift_labels" in batch:
        return int((batch["shift_labels"].chunk(2)[0] != IGNORE).sum())
    return int(target_counts(batch["labels"].chunk(2)[0]).sum())


def target_counts(labels: torch.Tensor) -> torch.Tensor:
    """Label tokens of each row after the shift."""
    return (labels[:, 1:] != IGNORE).sum(dim=1)


@dataclass
class PairTerms:
    losses: torch.Tensor
    """Per-pair preference loss (to be averaged over the pairs of the global batch)."""
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    nll: torch.Tensor
    """Per-pair weighted NLL of the chosen completion's tokens (ORPO's second term, or dpo.sft_weight's; else
    zero), to be summed over the chosen tokens of the global batch."""

    @property
    def nll_sum(self) -> torch.Tensor:
        return self.nll.sum()


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
    nll = -nll_weight(cfg) * chosen
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
    counts (`toolkit.train.loss.backward_scale`)."""
    return terms.losses.sum() * pair_scale + terms.nll_sum * token_scale


# Per-pair means logged beside the loss, in the order metrics.jsonl has them.
MEANS = (
    "rewards_chosen",
    "rewards_rejected",
    "reward_accuracy",
    "reward_margin",
    "logps_chosen",
    "logps_rejected",
)
# Every sum kept, and the order they travel in the one reduction over ranks.
SUMS = ("pair_loss", "chosen_nll", *MEANS, "pairs", "chosen_tokens")


class PairSums:
    """Named float64 sums over pairs (a step's, or the eval set's), kept on `device` until `reduce` adds
    them over ranks; `metrics` turns them into the logged loss and per-pair means."""

    def __init__(self, device=None):
        self.sums = {name: torch.zeros((), dtype=torch.float64, device=device) for name in SUMS}

    def add(self, terms: PairTerms, logps: torch.Tensor, counts: torch.Tensor, keep=None) -> None:
        """Add a stacked micro-batch's pairs; `keep` (one flag per pair) leaves out padding copies."""
        chosen, rejected = logps.detach().double().chunk(2)
        margin = (terms.chosen_rewards - terms.rejected_rewards).double()
        per_pair = {
            "pair_loss": terms.losses.detach(),
            "chosen_nll": terms.nll.detach(),
            "rewards_chosen": terms.chosen_rewards,
            "rewards_rejected": terms.rejected_rewards,
            "reward_accuracy": margin > 0,
            "reward_margin": margin,
            "logps_chosen": chosen,
            "logps_rejected": rejected,
            "pairs": torch.ones_like(chosen),
            "chosen_tokens": counts.chunk(2)[0],
        }
        weight = torch.ones_like(chosen) if keep is None else torch.as_tensor(keep).to(chosen)
        for name in SUMS:
            self.sums[name] += (per_pair[name].double() * weight).sum()

    def reduce(self, accelerator) -> PairSums:
        """Collective: the sums added over every rank in one reduction, in place; returns self."""
        stacked = sum_over_data(accelerator, torch.stack([self.sums[name] for name in SUMS]))
        self.sums = dict(zip(SUMS, stacked.unbind(), strict=True))
        return self

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """The loss, normalised as the step's objective is (pair losses per pair, NLL per chosen token),
        and the per-pair means."""
        sums = dict(zip(SUMS, torch.stack([self.sums[name] for name in SUMS]).tolist(), strict=True))
        pairs = max(sums["pairs"], 1)
        loss = sums["pair_loss"] / pairs + sums["chosen_nll"] / max(sums["chosen_tokens"], 1)
        return {f"{prefix}loss": loss, **{f"{prefix}{name}": sums[name] / pairs for name in MEANS}}
