"""The contrastive loss of embeddings (InfoNCE): each query's positive against every positive and hard
negative of the global batch, gathered from every process with their gradients, over cosine similarities
divided by a temperature; with Matryoshka sizes, the mean of that loss over the full vectors and their
leading parts. A step's loss is the mean over the global batch's queries: each process sums its own
queries' losses and the recipe scales by the global count (`toolkit.train.loss.backward_scale`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from toolkit.embed.data import groups


class _GatherWithGrad(torch.autograd.Function):
    """All processes' rows, in rank order; backward hands each process the gradient every process's loss
    gave its own rows (an all-reduce, which every backend has, then this process's slice)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor) -> torch.Tensor:
        ctx.rank, ctx.count = dist.get_rank(), rows.shape[0]
        parts = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, rows.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.count : (ctx.rank + 1) * ctx.count]


def gather_with_grad(rows: torch.Tensor) -> torch.Tensor:
    """Collective: every process's `rows` (the same count on each) stacked in rank order, differentiable;
    `rows` itself on one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rows
    return _GatherWithGrad.apply(rows)


def process_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@dataclass
class ContrastiveTerms:
    loss_sum: torch.Tensor
    """This process's queries' losses, summed (differentiable)."""
    correct: int
    """Of this process's queries, those whose positive scored highest among every candidate."""
    queries: int


def info_nce(
    anchors: torch.Tensor,
    positives: torch.Tensor,
    negatives: torch.Tensor | None,
    temperature: float,
    dims: list[int] = (),
) -> ContrastiveTerms:
    """Collective: the loss of this process's `anchors` (rows x width, unnormalised) against the positives
    and `negatives` of every process; `dims`: Matryoshka sizes trained beside the full width."""
    candidates = gather_with_grad(positives)
    if negatives is not None and negatives.shape[0]:
        candidates = torch.cat([candidates, gather_with_grad(negatives)])
    targets = process_rank() * anchors.shape[0] + torch.arange(anchors.shape[0], device=anchors.device)
    levels = [anchors.shape[-1], *[d for d in dims if d < anchors.shape[-1]]]
    losses = anchors.new_zeros(anchors.shape[0])
    for width in levels:
        queries = F.normalize(_at_least_float32(anchors[:, :width]), dim=-1)
        keys = F.normalize(_at_least_float32(candidates[:, :width]), dim=-1)
        logits = queries @ keys.T / temperature
        losses = losses + F.cross_entropy(logits, targets, reduction="none")
        if width == levels[0]:
            correct = int((logits.detach().argmax(-1) == targets).sum())
    return ContrastiveTerms((losses / len(levels)).sum(), correct, anchors.shape[0])


def step_terms(
    vectors: torch.Tensor, negatives: int, temperature: float, dims: list[int]
) -> ContrastiveTerms:
    """Collective: `info_nce` of one process's share of the step, its texts' `vectors` stacked as the
    collator stacks them (anchors, positives, `negatives` per row)."""
    split = groups(vectors, negatives)
    return info_nce(split["anchor"], split["positive"], split.get("negative"), temperature, dims)


def cached_gradients(
    micro_vectors: list[torch.Tensor], negatives: int, temperature: float, dims: list[int]
) -> tuple[ContrastiveTerms, list[torch.Tensor]]:
    """Collective, GradCache's middle: the step's loss from each micro-batch's vectors computed without
    gradients, and the gradient of every process's summed loss with respect to each micro-batch's vectors
    (what `surrogate` gives its recomputed vectors)."""
    leaves = [_at_least_float32(v.detach()).requires_grad_() for v in micro_vectors]
    by_group = [groups(leaf, negatives) for leaf in leaves]
    stacked = torch.cat([torch.cat([g[name] for g in by_group]) for name in by_group[0]])
    terms = step_terms(stacked, negatives, temperature, dims)
    terms.loss_sum.backward()
    return terms, [leaf.grad for leaf in leaves]


def surrogate(vectors: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A scalar whose gradient through a micro-batch's `vectors` (recomputed with gradients) is what the
    whole step's loss gives them: the sum of each vector times its cached gradient."""
    return (_at_least_float32(vectors) * grad).sum()


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))
