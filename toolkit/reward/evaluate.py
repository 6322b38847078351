"""Held-out pairs of a reward model: loss, pairwise accuracy (the chosen answer scored higher), mean margin
and mean rewards over the whole eval set, on every rank."""

from __future__ import annotations

import torch

from toolkit.distributed import data_shard
from toolkit.model.speed import eager_blocks
from toolkit.preference.data import strided_batches
from toolkit.reward.config import RewardConfig
from toolkit.reward.loss import RewardSums, batch_rewards, reward_terms
from toolkit.train.evaluate import eval_mode


@torch.no_grad()
def evaluate_rewards(model, dataset, collate, accelerator, cfg: RewardConfig, batch_size: int) -> dict:
    """Collective: eval_* metrics over every pair of `dataset` (compiled blocks run eagerly: an eval-mode
    graph would be one more compilation)."""
    sums = RewardSums(accelerator.device)
    with eager_blocks(), eval_mode(model):
        for rows, real in strided_batches(dataset, *data_shard(accelerator), batch_size):
            batch = {k: v.to(accelerator.device) for k, v in collate(rows).items()}
            sums.add(reward_terms(cfg, batch_rewards(model, batch), batch["margin"]), keep=real)
    return sums.reduce(accelerator).metrics(prefix="eval_")


class RewardEvaluator:
    """The held-out pairs' evaluations: metrics at `evaluate`, and the printed before/after line at
    `report` (what the run's closing lines read, from `shown`)."""

    def __init__(self, accelerator, model, dataset, collate, cfg, log):
        self.accelerator, self.model, self.dataset, self.collate = accelerator, model, dataset, collate
        self.cfg, self.log = cfg, log
        self.shown: dict[str, dict] = {}

    def _metrics(self) -> dict:
        return evaluate_rewards(
            self.model,
            self.dataset,
            self.collate,
            self.accelerator,
            self.cfg.reward,
            self.cfg.train.micro_batch_size,
        )

    def evaluate(self, step: int) -> dict:
        """Collective: eval_* metrics logged at `step`; {} when the run has no eval pairs."""
        return self.log.write(step, **self._metrics()) if self.dataset is not None else {}

    def report(self, step: int, label: str) -> None:
        """Collective: the metrics, shown (tagged `label`) and logged."""
        if self.dataset is None:
            return
        results = self.shown[label] = self._metrics()
        self.accelerator.print(f"[{label}] " + "  ".join(f"{k}={v:.4g}" for k, v in results.items()))
        self.log.write(step, **results)
