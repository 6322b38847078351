"""KTO's loss on rows of one completion (toolkit/preference/unpaired.py), as Ethayarajh et al. (2024)
define it: a row's log-ratio r = log pi(y|x) - log pi_ref(y|x) is weighed against z, the KL estimate: the
mean log-ratio of mismatched completions (another row's answer after this row's prompt), clamped at 0 and
not differentiated. A desirable row's loss is kto.desirable_weight x (1 - sigmoid(beta (r - z))), an
undesirable row's kto.undesirable_weight x (1 - sigmoid(beta (z - r))); a step's loss is their mean over
the rows of the global batch.

z is the step's: its mismatched rows over every micro-batch and rank (TRL averages per-micro-batch
estimates over processes), so the split into micro-batches and processes does not change it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from toolkit.distributed import data_shard, sum_over_data
from toolkit.errors import UserError
from toolkit.model.speed import eager_blocks
from toolkit.preference.config import PreferenceConfig
from toolkit.preference.data import strided_batches
from toolkit.preference.evaluate import PairEvaluator
from toolkit.preference.loss import batch_sequence_logps
from toolkit.preference.reference import frozen

ROW_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")


def half(batch: dict, side: int) -> dict:
    """The rows' own completions (side 0) or their mismatched ones (side 1) of a stacked batch."""
    return {key: batch[key].chunk(2)[side] for key in ROW_KEYS if key in batch}


@dataclass
class KtoTerms:
    losses: torch.Tensor
    """Per-row weighted loss (to be averaged over the rows of the global batch)."""
    rewards: torch.Tensor
    """beta x each row's log-ratio."""
    desirable: torch.Tensor


def kto_terms(cfg: PreferenceConfig, logps, ref_logps, labels, kl) -> KtoTerms:
    """Losses of rows with completion log-probs `logps` (and the reference's), flags `labels` and the KL
    estimate `kl`."""
    beta, desirable = cfg.dpo.beta, labels.bool()
    ratio = logps - ref_logps.to(logps)
    kl = kl.to(logps)
    losses = torch.where(
        desirable,
        cfg.kto.desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
        cfg.kto.undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))),
    )
    return KtoTerms(losses, beta * ratio.detach(), desirable)


def kl_sums(logps, ref_logps, keep=None) -> torch.Tensor:
    """(summed log-ratio, count) of mismatched rows; `keep` leaves out padding copies."""
    weight = torch.ones_like(logps, dtype=torch.float64) if keep is None else torch.as_tensor(keep).double()
    weight = weight.to(logps.device)
    return torch.stack([((logps - ref_logps.to(logps)).double() * weight).sum(), weight.sum()])


def kl_estimate(accelerator, sums: torch.Tensor) -> torch.Tensor:
    """Collective: z from this rank's `kl_sums`, over every rank."""
    total = sum_over_data(accelerator, sums)
    return (total[0] / total[1].clamp(min=1)).clamp(min=0)


SUMS = ("loss", "rewards_chosen", "rewards_rejected", "logps_chosen", "logps_rejected", "desirable", "rows")


class KtoSums:
    """Float64 sums over rows (a step's or the eval set's) beside the step's KL estimate; `reduce` adds them
    over ranks, `metrics` gives the loss and each kind's mean reward and log-prob ("chosen": desirable)."""

    def __init__(self, device, kl: torch.Tensor):
        self.sums = torch.zeros(len(SUMS), dtype=torch.float64, device=device)
        self.kl = kl

    def add(self, terms: KtoTerms, logps: torch.Tensor, keep=None) -> None:
        weight = torch.ones_like(terms.rewards, dtype=torch.float64)
        if keep is not None:
            weight = torch.as_tensor(keep).to(weight)
        good, bad = terms.desirable.double() * weight, (~terms.desirable).double() * weight
        rewards, logps = terms.rewards.double(), logps.detach().double()
        values = [
            terms.losses.detach().double() * weight,
            rewards * good,
            rewards * bad,
            logps * good,
            logps * bad,
        ]
        self.sums += torch.stack([v.sum() for v in values] + [good.sum(), weight.sum()])

    def reduce(self, accelerator) -> KtoSums:
        """Collective: the sums added over every rank, in place; returns self."""
        self.sums = sum_over_data(accelerator, self.sums)
        return self

    def metrics(self, prefix: str = "") -> dict[str, float]:
        sums = dict(zip(SUMS, self.sums.tolist(), strict=True))
        good, bad = max(sums["desirable"], 1), max(sums["rows"] - sums["desirable"], 1)
        means = {
            "loss": sums["loss"] / max(sums["rows"], 1),
            "rewards_chosen": sums["rewards_chosen"] / good,
            "rewards_rejected": sums["rewards_rejected"] / bad,
            "reward_margin": sums["rewards_chosen"] / good - sums["rewards_rejected"] / bad,
            "logps_chosen": sums["logps_chosen"] / good,
            "logps_rejected": sums["logps_rejected"] / bad,
            "kl": float(self.kl),
        }
        return {f"{prefix}{name}": value for name, value in means.items()}


def row_step(run, model, micro_batches: list[dict], reference, cfg: PreferenceConfig, row_scale: float):
    """Collective: forward and backward of a step's KTO rows; returns their KtoSums, ready for `reduce`.
    The mismatched rows go through the policy first, without gradients, for the step's KL estimate."""
    accelerator = run.accelerator
    if "shift_labels" in micro_batches[0]:
        raise UserError("sequence parallelism: dpo.loss kto scores whole rows; launch without sp")
    refs = [reference.logps(batch) for batch in micro_batches]
    sums = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for batch, ref in zip(micro_batches, refs, strict=True):
            sums += kl_sums(batch_sequence_logps(model, half(batch, 1))[0], ref.chunk(2)[1])
    step = KtoSums(accelerator.device, kl_estimate(accelerator, sums))
    for batch, ref in zip(micro_batches, refs, strict=True):
        rows = half(batch, 0)
        with accelerator.accumulate(model), run.micro_batch() as router:
            logps = batch_sequence_logps(model, rows)[0]
            terms = kto_terms(cfg, logps, ref.chunk(2)[0], batch["label"], step.kl)
            accelerator.backward(terms.losses.sum() * row_scale + router.loss(rows["attention_mask"]))
            step.add(terms, logps)
    return step


@torch.no_grad()
def evaluate_rows(model, dataset, collate, accelerator, cfg: PreferenceConfig, reference, batch_size: int):
    """Collective: eval_* metrics over every row of `dataset`, z estimated over the whole set."""
    kept, sums = [], torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    with eager_blocks(), frozen(model):
        for rows, real in strided_batches(dataset, *data_shard(accelerator), batch_size):
            batch = {k: v.to(accelerator.device) for k, v in collate(rows).items()}
            (own, mismatched), (ref_own, ref_mismatched) = (
                values.chunk(2) for values in (batch_sequence_logps(model, batch)[0], reference(batch))
            )
            sums += kl_sums(mismatched, ref_mismatched, real)
            kept.append((own, ref_own, batch["label"], real))
    result = KtoSums(accelerator.device, kl_estimate(accelerator, sums))
    for own, ref_own, labels, real in kept:
        result.add(kto_terms(cfg, own, ref_own, labels, result.kl), own, real)
    return result.reduce(accelerator).metrics(prefix="eval_")


class RowEvaluator(PairEvaluator):
    """PairEvaluator for KTO rows: their metrics over every held-out row; exact match of greedy answers
    against the desirable rows' completions."""

    def __init__(self, accelerator, model, tokenizer, dataset, collate, cfg, reference, log):
        self.rows = dataset
        desirable = dataset.select(np.flatnonzero(dataset["label"])) if dataset is not None else None
        super().__init__(accelerator, model, tokenizer, desirable, collate, cfg, reference, log)

    def _metrics(self) -> dict:
        return evaluate_rows(
            self.model,
            self.rows,
            self.collate,
            self.accelerator,
            self.cfg,
            lambda batch: self.reference.logps(batch, "eval"),
            self.cfg.train.micro_batch_size,
        )
