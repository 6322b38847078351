"""Packed rows on layers that carry a state along the sequence, exactly: each recurrent layer's module (gated
DeltaNet, Kimi delta attention, short convolution, Mamba-2) runs on each packed example's span of the row
alone, so its state starts from zero in every example, while attention, MLPs and norms run on the whole
row (restarted position ids keep attention apart).

The spans come from the position ids the packed collator gives (every example restarts at 0), read as the
decoder stack is called; a batch with an attention mask or a cache (unpacked rows, generation) runs
whole. On a GPU with the kind's kernel packages transformers hands the kernels the boundaries instead
(`cu_seq_lens_q`, `seq_idx`, the rows as one row, as they require); its PyTorch versions refuse or ignore
them, and Kimi delta attention's kernel never gets them, so those run one example at a time.
"""

from __future__ import annotations

import importlib.util
from itertools import pairwise

import torch

from toolkit.model.families import KERNEL_MODULES, Family, LayerKind

# Batch entries that only a kernel reads; a module run per example never gets them.
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


class Spans:
    """The packed examples of the forward pass running now: per row, (start, end) of each example; None
    when the batch is not packed (or holds one example per row)."""

    def __init__(self):
        self.rows: list[list[tuple[int, int]]] | None = None

    def read(self, _module, _args, kwargs: dict) -> None:
        """A forward pre-hook on the decoder stack: a gradient-checkpointed layer recomputed in the backward
        pass sees the same spans, since no other forward runs in between."""
        positions = kwargs.get("position_ids")
        unpacked = kwargs.get("attention_mask") is not None or kwargs.get("past_key_values") is not None
        self.rows = None if positions is None or unpacked else example_spans(positions)


def example_spans(positions: torch.Tensor) -> list[list[tuple[int, int]]] | None:
    """Each row's examples as (start, end): a new one wherever the position restarts at 0 (a rotary model
    with several position streams gives the text stream first)."""
    if positions.dim() == 3:
        positions = positions[0]
    width = positions.shape[1]
    rows = []
    for row in (positions == 0).tolist():
        starts = sorted({0, *(i for i, first in enumerate(row) if first)})
        rows.append(list(pairwise([*starts, width])))
    return rows if any(len(spans) > 1 for spans in rows) else None


def run_per_example(run, spans: Spans):
    """`run` (a module's forward) on each packed example's span alone when the batch is packed."""

    def forward(*args, **kwargs):
        if spans.rows is None:
            return run(*args, **kwargs)
        if "hidden_states" in kwargs:
            hidden, rest = kwargs.pop("hidden_states"), args
        else:
            hidden, rest = args[0], args[1:]
        mask = kwargs.pop("attention_mask", None)
        for key in BOUNDARY_KEYS:
            kwargs.pop(key, None)
        rows = []
        for r, row in enumerate(spans.rows):
            parts = []
            for a, b in row:
                part_mask = mask[r : r + 1, a:b] if mask is not None and mask.dim() == 2 else None
                parts.append(run(hidden[r : r + 1, a:b], *rest, attention_mask=part_mask, **kwargs))
            rows.append(torch.cat(parts, dim=1))
        return torch.cat(rows, dim=0)

    return forward


def run_with_boundaries(run, spans: Spans):
    """`run` on the batch's rows as one row, with the packed examples' boundaries for the GPU kernels."""

    def forward(hidden_states, *args, **kwargs):
        if spans.rows is None:
            return run(hidden_states, *args, **kwargs)
        batch, width = hidden_states.shape[:2]
        lengths = [b - a for row in spans.rows for a, b in row]
        device = hidden_states.device
        cumulative = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
        seq_idx = torch.repeat_interleave(
            torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
        )
        kwargs.update(attention_mask=None, cu_seq_lens_q=cumulative, seq_idx=seq_idx.to(torch.int32)[None])
        out = run(hidden_states.reshape(1, batch * width, -1), *args, **kwargs)
        return out.reshape(batch, width, -1)

    return forward


def has_kernels(kind: LayerKind) -> bool:
    return all(importlib.util.find_spec(KERNEL_MODULES[name]) is not None for name in kind.kernels)


def install(model: torch.nn.Module, family: Family, on_gpu: bool) -> list[str]:
    """Make `model`'s recurrent layers keep packed examples apart; a line per layer kind saying how.
    Every recurrent layer the family counts must be found, or packing would leak: a programming error."""
    spans, lines, wrapped = Spans(), [], []
    for kind in family.recurrent:
        found = [m for m in model.modules() if type(m).__name__.endswith(kind.modules)]
        if len(found) != family.count(kind):
            raise RuntimeError(
                f"{family.model_type}: {len(found)} {kind.name} modules, expected {family.count(kind)}"
            )
        kernels = on_gpu and kind.boundaries and has_kernels(kind)
        for module in found:
            wrap = run_with_boundaries if kernels else run_per_example
            module.forward = wrap(module.forward, spans)
        wrapped += found
        how = f"get the boundaries ({', '.join(kind.kernels)})" if kernels else "run each example on its own"
        lines.append(f"packing: {family.model_type}'s {kind.name} layers {how}")
    if wrapped:
        decoder_stack(model, wrapped[0]).register_forward_pre_hook(spans.read, with_kwargs=True)
    return lines


def decoder_stack(model: torch.nn.Module, layer: torch.nn.Module) -> torch.nn.Module:
    """The innermost module whose `layers` hold `layer`: it is called with the batch's position ids."""
    stacks = [
        m
        for m in model.modules()
        if isinstance(getattr(m, "layers", None), torch.nn.ModuleList)
        and any(x is layer for x in m.layers.modules())
    ]
    return stacks[-1]
