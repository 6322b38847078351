"""A preference step through a pipeline's stages: the reference log-probs of the step's micro-batches in
one forward pass, then one schedule step whose last stage turns each micro-batch's per-token log-probs
into its pair objective, exactly as `loss.micro_objective` does for a whole model."""

from __future__ import annotations

import torch

from toolkit.preference.config import DpoConfig
from toolkit.preference.loss import PairSums, micro_objective, pair_terms, target_counts


def pair_step(pipeline, micro_batches, reference, cfg: DpoConfig, pair_scale: float, token_scale: float):
    """Collective: forward and backward of the step's pairs; returns their PairSums on every rank of the
    pipeline (the last stage holds them, the others receive them), ready for `reduce`."""
    device = pipeline.accelerator.device
    refs = reference.step_logps(micro_batches)
    # Each row's target: (reference log-prob, label tokens); the schedule cuts it by micro-batch.
    targets = [
        torch.stack(
            [
                refs[i].double() if refs is not None else torch.zeros(len(b["labels"]), device=device),
                target_counts(b["labels"]).double().to(device),
            ],
            dim=1,
        )
        for i, b in enumerate(micro_batches)
    ]

    def terms_of(logps, target):
        return pair_terms(cfg, logps, target[:, 1], target[:, 0] if refs is not None else None)

    def objective(token_logps, target):
        return micro_objective(terms_of(token_logps.sum(dim=1), target), pair_scale, token_scale)

    sums = PairSums(device)
    for logps, target in pipeline.run_step(micro_batches, objective, targets=targets):
        sums.add(terms_of(logps, target), logps, target[:, 1])
    for value in sums.sums.values():
        pipeline.share(value)
    return sums
