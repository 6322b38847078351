"""What the embedding recipe's step holds besides the transformer's activations (`ftkit plan --objective
embed`), and the plan's line about it. The model has no LM head: an embedding model is the bare
transformer pooled to one vector a text, a reranker or classifier its sequence classifier, whose head gives
1 or `labels` scores a sequence (`plan.counts` counts either). A row puts several sequences through the
model (`PlanRequest.rows_per_example`): an anchor, its positive and its hard negatives; a listwise reranker
its query paired with each candidate.

The contrastive loss (toolkit/embed/loss.py), per process, with q = global batch / processes queries,
K = global batch x (1 + negatives) candidates gathered from every process, width h, in bytes (fp32):

    vectors       12h(q + K)   queries and candidates: their fp32 values, normalised copies, gradients
    similarities  12qK         the q x K logits, their softmax and its gradient

GradCache (`embed.cached`, or several micro-batches a process): the activations are one micro-batch's (the
rows' micro-batch), and the vectors of the process's whole share of the batch wait between the passes:

    stored        q x sequences a row x h x (e + 8)   each vector in the compute dtype (e bytes), its fp32
                                                      copy and that copy's gradient

Each Matryoshka size d below the width adds its own vectors and logits, 12d(q + K) + 12qK: its slices'
normalised copies and gradients and its own q x K logits, all kept for the backward pass. A reranker's or
classifier's scores are 12 bytes a score (fp32 scores, probabilities, gradient)."""

from __future__ import annotations

from toolkit.plan.memory import Precision, compute_bytes
from toolkit.plan.request import PlanRequest


def is_cached(request: PlanRequest, accumulation: int) -> bool:
    """Whether the embedding step runs GradCache: asked for, or forced by several micro-batches a process."""
    return request.embedding and (request.cached or accumulation > 1)


def loss_bytes(counts, request: PlanRequest, precision: Precision, processes: int, micro: int) -> int:
    """The loss's memory on one process at its peak (see the module's docstring)."""
    if not request.embedding:
        return 12 * micro * request.rows_per_example * request.head_width
    queries = request.global_batch // processes
    candidates = request.global_batch * (1 + request.negatives)
    widths = [counts.hidden, *(d for d in request.matryoshka_dims if d < counts.hidden)]
    loss = sum(12 * width * (queries + candidates) + 12 * queries * candidates for width in widths)
    if not is_cached(request, queries // micro):
        return loss
    stored = queries * request.rows_per_example * counts.hidden * (compute_bytes(precision) + 8)
    return loss + stored


def describe(request: PlanRequest, hidden: int, micro: int | None, processes: int) -> str:
    """The plan's line about an embedding run: the sequences a step, the head, and GradCache."""
    n = request.negatives
    negatives = f" + {n} hard negative{'s' * (n != 1)}" if n else ""
    if request.embed_task == "classifier":
        row, head = "a text", f"a head of {request.labels} scores"
    elif request.embed_task == "reranker":
        row, head = f"the query paired with its positive{negatives}", "a head of one score"
    else:
        row, head = f"anchor + positive{negatives}", f"no head: pooled vectors of width {hidden}"
        smaller = [str(d) for d in request.matryoshka_dims if d < hidden]
        if smaller:
            head += f" (and Matryoshka {', '.join(smaller)}, each with its own logits)"
    sequences = request.global_batch * request.rows_per_example
    line = (
        f"embed    {request.embed_task}: {request.global_batch} rows x ({row}) = {sequences} sequences a "
        f"step; {head}"
    )
    if micro is None or not request.embedding:
        return line
    queries = request.global_batch // processes
    if not is_cached(request, queries // micro):
        return f"{line}; one pass a step, the loss over every process's vectors"
    return (
        f"{line}; cached (GradCache): one micro-batch of {micro} row{'s' * (micro != 1)}' activations at a "
        f"time, plus the "
        f"{queries * request.rows_per_example} vectors of the process's {queries} rows between the passes "
        "(one more forward pass)"
    )
