"""The clipped policy-ratio loss on per-token log-probs of completions, with an optional KL to a reference.

Per completion token: -min(ratio x A, clip(ratio, 1 - epsilon, 1 + epsilon_high) x A) + beta x KL, where
ratio is the policy's probability over the sampling policy's and KL the k3 estimate exp(d) - d - 1 with
d = reference log-prob - policy log-prob. A step's loss normalises the sum over its completion tokens:
grpo divides each completion's sum by its length and the total by the step's completions; dr_grpo divides
by completions x max_new_tokens; dapo by the step's completion tokens. The recipe scales each micro-batch's
sum by those global counts, so the split into micro-batches and processes leaves the gradient as is.
Completions a vLLM engine sampled weight each token's policy term by their importance weight, trainer over
engine probability: per token or per completion, truncated at a cap or masked outside it (`engine_weights`).
With grpo.teacher each token's advantage also holds teacher_weight x (teacher - policy log-prob), the
per-token reverse-KL signal of on-policy distillation (grpo/teacher.py).
"""

from __future__ import annotations

import torch

from toolkit.data.collate import model_inputs
from toolkit.data.encode import IGNORE
from toolkit.preference.reference import adapter_off, frozen, load_separate
from toolkit.train import head, truncation


def completion_logps(
    model, batch: dict, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Log-prob of each completion token under softmax(logits / temperature), the distribution the
    completions were sampled from, [rows, max_new_tokens] (0 past a completion's length); through the
    chunked head when the model has one. `top_k`, `top_p`: renormalised over the tokens a top-k / top-p
    sampler keeps (train/truncation.py), as an engine's log-probs are."""
    if head.chunked_head(model) is not None:
        logps = head.target_logps(model, batch, temperature=temperature, top_k=top_k, top_p=top_p)
    else:
        logits = model(**model_inputs(batch)).logits[:, :-1]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        targets = batch["labels"][:, 1:]
        logits = truncation.masked(logits, truncation.kept(logits, top_k, top_p, targets))
        picked = logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
        logps = picked.masked_fill(targets == IGNORE, 0.0)
    return _completion_columns(logps, batch["starts"], batch["lengths"])


def _completion_columns(logps: torch.Tensor, starts, lengths) -> torch.Tensor:
    """Position t of `logps` scores token t + 1: completion token j of a row starting at s is at s - 1 + j."""
    offsets = torch.arange(int(lengths.max()), device=logps.device)
    index = (starts[:, None] - 1 + offsets).clamp(max=logps.size(1) - 1)
    mask = offsets < lengths[:, None]
    return logps.gather(1, index).masked_fill(~mask, 0.0)


def token_mask(batch: dict, columns: int, dtype) -> torch.Tensor:
    """1 on the completion tokens the loss trains: within each one's length, and the model's own (a
    multi-turn conversation's environment tokens are 0)."""
    mask = (torch.arange(columns, device=batch["lengths"].device) < batch["lengths"][:, None]).to(dtype)
    if batch.get("mask") is not None:
        mask = mask * batch["mask"][:, :columns].to(dtype)
    return mask


def micro_terms(cfg, logps: torch.Tensor, batch: dict) -> dict[str, torch.Tensor]:
    """The micro-batch's summed objective (to be scaled by the step's count) and its metric sums."""
    columns = logps.size(1)
    mask = token_mask(batch, columns, logps.dtype)
    old = (
        batch["old_logps"][:, :columns].to(logps.dtype) if batch["old_logps"] is not None else logps.detach()
    )
    advantages = batch["advantages"].to(logps.dtype)[:, None]
    if batch.get("teacher_gap") is not None:  # distillation: each token's own advantage (grpo/teacher.py)
        advantages = advantages + cfg.teacher_weight * batch["teacher_gap"][:, :columns].to(logps.dtype)
    ratio = torch.exp(logps - old)
    low, high = 1 - cfg.epsilon, 1 + (cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon)
    per_token = -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    weight_sum = outside = torch.zeros((), dtype=logps.dtype, device=logps.device)
    if cfg.engine_is_cap > 0 and batch.get("engine_logps") is not None:
        # The engine sampled the tokens, not the trainer's weights: each token's policy term is weighted by
        # their probabilities' ratio, truncated (TIS) or masked, so a token the engine oversampled counts
        # less.
        sampled_by = batch["engine_logps"][:, :columns].to(logps.dtype)
        weight, raw, dropped = engine_weights(cfg, (old - sampled_by) * mask)
        per_token = per_token * weight
        weight_sum, outside = (raw * mask).sum(), (dropped.to(mask.dtype) * mask).sum()
    kl = torch.zeros_like(per_token)
    if cfg.beta > 0:
        gap = batch["ref_logps"][:, :columns].to(logps.dtype) - logps
        kl = torch.exp(gap) - gap - 1
        per_token = per_token + cfg.beta * kl
    per_token = per_token * mask
    if cfg.loss == "grpo":
        objective = (per_token.sum(1) / mask.sum(1).clamp(min=1)).sum()
    elif cfg.loss == "dr_grpo":
        objective = per_token.sum() / cfg.max_new_tokens
    else:
        objective = per_token.sum()
    clipped = ((ratio < low) & (advantages < 0)) | ((ratio > high) & (advantages > 0))
    return {
        "objective": objective,
        "kl_sum": (kl.detach() * mask).sum(),
        "clipped": (clipped.float() * mask).sum(),
        "engine_is_weight": weight_sum,
        "engine_is_outside": outside,
    }


# The per-micro-batch sums `micro_terms` returns, in order: what a step adds up over its micro-batches.
SUMMED_TERMS = 5


def engine_weights(cfg, log_ratio: torch.Tensor):
    """(applied weight, raw weight, whether truncated or masked), [rows, columns], from each trained token's
    log(p_trainer / p_engine) (0 off the trained tokens). grpo.engine_is_level sequence gives every token
    of a completion the product of its tokens' ratios; grpo.engine_is_mode truncate caps a weight at
    grpo.engine_is_cap, mask zeroes one outside [1 / cap, cap]."""
    if cfg.engine_is_level == "sequence":
        log_ratio = log_ratio.sum(1, keepdim=True).expand_as(log_ratio)
    raw = torch.exp(log_ratio)
    cap = cfg.engine_is_cap
    if cfg.engine_is_mode == "mask":
        dropped = (raw > cap) | (raw < 1 / cap)
        return raw.masked_fill(dropped, 0.0), raw, dropped
    return raw.clamp(max=cap), raw, raw > cap


def normaliser(cfg, completions: int, tokens: int) -> int:
    """What a step's summed objective is divided by: completions (grpo, dr_grpo) or tokens (dapo)."""
    return tokens if cfg.loss == "dapo" else completions


class Reference:
    """Per-token reference log-probs: a separate frozen model, or the policy with its adapter off."""

    def __init__(self, accelerator, model, separate=None):
        self.accelerator, self.model, self.separate = accelerator, model, separate

    @classmethod
    def build(cls, accelerator, model, cfg, features) -> Reference | None:
        """Collective: None without a KL term (grpo.beta 0)."""
        if cfg.grpo.beta == 0:
            return None
        path = cfg.grpo.reference_model
        separate = load_separate(accelerator, cfg, features, path, "grpo.reference_model") if path else None
        return cls(accelerator, model, separate)

    def logps(self, batch: dict, temperature: float) -> torch.Tensor:
        if self.separate is not None:
            with frozen(self.separate):
                return completion_logps(self.separate, batch, temperature)
        with frozen(self.model), adapter_off(self.accelerator, self.model):
            return completion_logps(self.model, batch, temperature)
