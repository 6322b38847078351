"""GRPO's generation phase in `ftkit plan`: what one GPU holds while a round samples its completions.

A GRPO step alternates two phases that never overlap: a round generates completions (no gradients), then
the optimizer steps train on them. A setup fits when the larger of the two does. While generating, a GPU
keeps what outlives an optimizer step (`ModelStateBytes.after_step`, a separate reference) and adds, for the
R completions it generates at once (grpo.generation_batch_size, or its whole share of the round) of
T = prompt (data.max_length) + grpo.max_new_tokens tokens each, with e bytes per activation:

    gathered   ZeRO-3/FSDP with grpo.gather_for_generation: the whole model in the dtype training keeps it,
               beside the shards; without it, the layers gathered one at a time as in training
    kv cache   (C + S) x e x R: C what the attention layers cache for T tokens, per layer 2 (K and V) x kv
               heads x head dim (with multi-head latent attention kv_lora_rank + qk_rope_head_dim) a token,
               a sliding-window layer its window's tokens only; S the state of the recurrent layers (linear
               attention, short convolution, Mamba), one per sequence whatever its length
    logits     one step's next-token scores of every row: R x vocab x (e + SAMPLING_BYTES)
    prefill    the prompts' pass through one decoder layer (no gradients: each layer's is freed after it)

Under tensor parallelism each rank holds its share of the kv heads (MLA's latent cache whole), of the
recurrent states and of the MLP, and gathers only its own part of the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from toolkit.model.families import cache_elements
from toolkit.plan import memory
from toolkit.plan.footprint import GenerationBytes, ModelStateBytes
from toolkit.plan.memory import Precision

SAMPLING_BYTES = 4 + 4 + 3 * 8
"""Bytes per row and vocabulary entry the sampler adds to the model's logits (toolkit/grpo/sampling.py):
generate's float32 copy, the processor's scaled float32 scores, and its Gumbel noise (float64 uniforms with
two float64 temporaries at once); top-k and top-p add their own copies, not counted."""


@dataclass(frozen=True)
class Round:
    """A GRPO round as the plan sees it (the recipe's grpo section)."""

    completions: int
    """Completions a round samples across all GPUs: global batch x steps per generation."""
    batch: int
    """grpo.generation_batch_size: completions a process generates at once (0: its whole share)."""
    prompt_tokens: int
    new_tokens: int
    gather: bool
    """grpo.gather_for_generation."""

    def rows(self, data_parallel: int) -> int:
        """Completions one GPU generates at once: its share of the round (the recipe splits it in whole
        completions, the first processes' shares rounded up), in batches of `batch`."""
        share = math.ceil(self.completions / data_parallel)
        return min(self.batch, share) if self.batch else share


def estimate(
    counts,
    backend: str,
    n_gpus: int,
    states: ModelStateBytes,
    precision: Precision,
    plan_round: Round,
    reference: int = 0,
    data_parallel: int = 1,
    tp: int = 1,
) -> GenerationBytes:
    """The generation phase on one GPU of `backend`; `counts` are what one tensor-parallel rank holds
    (`parallel.rank_counts`), the kv heads and MLP width still the whole model's."""
    e = memory.compute_bytes(precision)
    rows = plan_round.rows(data_parallel)
    tokens = plan_round.prompt_tokens + plan_round.new_tokens
    resident = (states.persistent if states.in_cpu_ram else states.after_step) + reference
    gathered = gathered_bytes(counts, backend, precision, plan_round.gather)
    cached = cache_elements(counts.cache, tokens) // (1 if counts.latent_cache else tp)
    kv_cache = (cached + counts.state_per_sequence // tp) * e * rows
    logits = rows * counts.vocab * (e + SAMPLING_BYTES)
    per_token = memory.residual_bytes(counts, precision) * counts.hidden + 3 * e * counts.intermediate // tp
    prefill = rows * plan_round.prompt_tokens * per_token
    tensors = resident + gathered + kv_cache + logits + prefill
    overhead = memory.overhead_bytes(tensors, backend, n_gpus, counts, precision)
    return GenerationBytes(rows, tokens, resident, gathered, kv_cache, logits, prefill, overhead)


def gathered_bytes(counts, backend: str, precision: Precision, gather: bool) -> int:
    """Weights a sharded backend gathers to generate: the whole model once per round (`gather`), else the
    layers one at a time at every token, as in training; nothing where every GPU holds them whole."""
    if backend not in memory.SHARDED_PARAMS:
        return 0
    if not gather:
        return memory.working_weight_bytes(counts, backend, precision)
    whole = memory.model_state_bytes(counts, backend, 1, precision)
    return whole.frozen + whole.trainable
