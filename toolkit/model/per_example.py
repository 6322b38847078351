"""Packed rows on layers that carry a state along the sequence, exactly: each recurrent layer's module (gated
DeltaNet, Kimi delta attention, short convolution, Mamba-2) runs on each packed example's span of the row
alone (the examples as a right-padded batch of their own), so its state starts from zero in every example,
while attention, MLPs and norms run on the whole row (restarted position ids keep attention apart).

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
    """The packed examples of the forward pass running now: their lengths, in the order of the batch's
    flattened rows; None when the batch is not packed (or holds one example per row)."""

    def __init__(self):
        self.lengths: list[int] | None = None

    def read(self, _module, _args, kwargs: dict) -> None:
        """A forward pre-hook on the decoder stack: a gradient-checkpointed layer recomputed in the backward
        pass sees the same spans, since no other forward runs in between."""
        positions = kwargs.get("position_ids")
        cached = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
        unpacked = kwargs.get("attention_mask") is not None or cached
        self.lengths = None if positions is None or unpacked else example_lengths(positions)


def example_lengths(positions: torch.Tensor) -> list[int] | None:
    """Each row's examples' lengths, row after row: a new example wherever the position restarts at 0 (a
    rotary model with several position streams gives the text stream first)."""
    if positions.dim() == 3:
        positions = positions[0]
    width = positions.shape[1]
    lengths = []
    for row in (positions == 0).tolist():
        starts = sorted({0, *(i for i, first in enumerate(row) if first)})
        lengths += [b - a for a, b in pairwise([*starts, width])]
    return lengths if len(lengths) > len(positions) else None


def run_per_example(run, spans: Spans):
    """`run` (a module's forward) on the packed examples as a batch of their own, each a row from its
    first token, right-padded (exact on every family, tests/unit/test_family_packing.py). One call, not
    one per example: ZeRO-3 gathers the module's weights once per call, and processes with different
    numbers of examples must gather alike."""

    def forward(*args, **kwargs):
        if spans.lengths is None:
            return run(*args, **kwargs)
        if "hidden_states" in kwargs:
            hidden, rest = kwargs.pop("hidden_states"), args
        else:
            hidden, rest = args[0], args[1:]
        for key in (*BOUNDARY_KEYS, "attention_mask"):
            kwargs.pop(key, None)
        lengths = torch.tensor(spans.lengths, device=hidden.device)
        real = torch.arange(int(lengths.max()), device=hidden.device) < lengths[:, None]
        examples = hidden.new_zeros(*real.shape, hidden.shape[-1])
        examples[real] = hidden.reshape(-1, hidden.shape[-1])
        out = run(examples, *rest, attention_mask=real.long(), **kwargs)
        return out[real].reshape(*hidden.shape[:2], -1)

    return forward


def run_with_boundaries(run, spans: Spans):
    """`run` on the batch's rows as one row, with the packed examples' boundaries for the GPU kernels."""

    def forward(hidden_states, *args, **kwargs):
        if spans.lengths is None:
            return run(hidden_states, *args, **kwargs)
        batch, width = hidden_states.shape[:2]
        lengths = torch.tensor(spans.lengths, device=hidden_states.device)
        cumulative = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
        seq_idx = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
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
