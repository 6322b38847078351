"""The tokens a top-k / top-p sampler can draw, so a log-prob is of the distribution sampled from.

A sampler with top-k and top-p draws from the tempered logits' softmax renormalised over a kept set: the k
largest logits (ties at the k-th kept), then, of those renormalised, the fewest largest whose probabilities
sum to at least p (the largest always kept). Transformers' logits warpers and vLLM's sampler keep the same
set, in that order, after the temperature; vLLM's processed log-probs are log-probs of that renormalised
distribution. GRPO scores its completions (policy, sampling policy, reference) under the same distribution:
with the whole softmax instead, a top-k engine's log-probs and the trainer's differ by log(kept mass) per
token and the importance weights shrink every update.
"""

from __future__ import annotations

import torch


def truncates(top_k: int, top_p: float) -> bool:
    return bool(top_k) or top_p < 1.0


def kept(logits: torch.Tensor, top_k: int, top_p: float, targets: torch.Tensor) -> torch.Tensor | None:
    """A bool mask the shape of `logits` ([..., vocab], tempered): True for the tokens the sampler could
    draw, and each position's target (`targets`, [...]; negative ones read as token 0) whatever it is, so
    a token sampled under other weights (an engine a round behind, rounding at the set's edge) keeps a
    finite log-prob. None when nothing is cut."""
    if not truncates(top_k, top_p):
        return None
    mask = torch.ones_like(logits, dtype=torch.bool)
    if top_k and top_k < logits.size(-1):
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        mask = logits >= kth
    if top_p < 1.0:
        ascending, order = logits.masked_fill(~mask, float("-inf")).sort(dim=-1)
        below = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        below[..., -1] = False
        mask &= ~below.scatter(-1, order, below)
    return mask.scatter_(-1, targets.clamp(min=0)[..., None], True)


def masked(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`logits` with the tokens outside `mask` at -inf (a new tensor), or `logits` itself without one."""
    return logits if mask is None else logits.masked_fill(~mask, float("-inf"))
