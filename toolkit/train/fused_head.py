"""The chunked head's per-chunk math in one function the compiler fuses: log-softmax, the target pick and
the gradient of log p(target) with respect to the head's output.

Eagerly, that math is a handful of passes over a chunk's float32 logits (`head._TargetLogps` runs them in
place, to hold one float32 copy). Compiled, it becomes a reduction and one element-wise kernel that read
the head's output in its own dtype and write the gradient in it: the float32 logits are never stored, and
no pass leaves the fused kernels. A run with compiled blocks (`model.compile`) compiles it too; everywhere
else, and under `eager_blocks`, the head keeps its eager passes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def chunk_math(scale: float, softcap: float | None) -> Callable:
    """The compiled per-chunk function for a model's logit shape (`head.LogitShape`: the output's scale,
    then a tanh cap). Its constants are bound here, so the compiler specialises on them once.

    The function takes the head's output `z` for a chunk of rows [rows, vocab], the rows' targets, the
    float dtype the log-probs are taken in, an optional per-row factor for the gradient, and whether the
    gradient is wanted; it returns (log p(target) [rows], d log p / dz in z's dtype, or None)."""

    def logps_and_grad(z, targets, dtype: torch.dtype, row_scale, want_grad: bool):
        logits = z.to(dtype)
        if scale != 1.0:
            logits = logits * scale
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        lse = torch.logsumexp(logits, dim=-1)
        logps = logits.gather(1, targets[:, None]).squeeze(1) - lse
        if not want_grad:
            return logps, None
        columns = torch.arange(logits.size(1), device=logits.device)
        dz = (columns == targets[:, None]).to(dtype) - torch.exp(logits - lse[:, None])
        if softcap:
            dz = dz * (1 - (logits / softcap) ** 2)
        if scale != 1.0:
            dz = dz * scale
        if row_scale is not None:
            dz = dz * row_scale[:, None]
        return logps, dz.to(z.dtype)

    # Rows per chunk change with every batch's label count: dynamic from the first call, one graph for all.
    return torch.compile(logps_and_grad, dynamic=True, fullgraph=True)


def chunk_bounds(n: int, size: int, fused: bool) -> list[slice]:
    """Chunks of `size` rows over `n` rows. For the `fused` math a last chunk of one row is folded into the
    one before it: a one-row input is a shape the compiler specialises (and would compile again for)."""
    bounds = [slice(start, min(start + size, n)) for start in range(0, n, size)]
    if fused and len(bounds) > 1 and bounds[-1].stop - bounds[-1].start == 1:
        bounds[-2:] = [slice(bounds[-2].start, n)]
    return bounds
