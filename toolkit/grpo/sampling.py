"""Completions sampled with HF generate, each with a seed of its own derived from (seed, round, prompt,
sample): the same completions come out however the round is split into processes and batches.

Sampling is done by the Gumbel-max trick: a logits processor applies temperature, top-k and top-p, then
adds Gumbel noise computed from the completion's seed and the token's place, and generate picks the
argmax, which is a draw from the processed distribution. No random state is shared between rows or kept
between tokens.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
from accelerate.utils import DistributedType
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from toolkit.distributed import root_params_gathered, unwrap
from toolkit.model.speed import eager_blocks


def completion_seed(seed: int, round_index: int, slot: int, prompt: int, sample: int) -> int:
    """A 63-bit seed from the run's seed, the round, the prompt's place in it (`slot`) and its index,
    and the sample's number: stable across processes, runs and Python versions."""
    key = f"{seed}/{round_index}/{slot}/{prompt}/{sample}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def group_seed(seed: int, round_index: int, slot: int, prompt: int) -> int:
    """The engine's seed of a prompt's first completion; its sample g is seeded this + g, as vLLM seeds the
    g-th of n completions one request asks for (grpo.vllm.n_per_prompt), so asked one by one or n at once
    they are the same. 55 bits: the group's seeds stay below 2**63."""
    return completion_seed(seed, round_index, slot, prompt, 0) >> 8


class SeededSampling(LogitsProcessor):
    """Temperature, top-k, top-p, then each row's Gumbel noise, a function of its seed, the new token's
    place in its completion and the vocabulary index alone: one batched computation per token."""

    def __init__(self, seeds: list[int], temperature: float, top_k: int, top_p: float, prompt_width: int):
        self.seeds = torch.tensor(seeds, dtype=torch.int64)
        self.temperature, self.prompt_width = temperature, prompt_width
        self.warpers = [TopKLogitsWarper(top_k)] if top_k else []
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))

    def processed(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The logits of the distribution a row's next token is drawn from: tempered, then truncated."""
        scores = scores.float() / self.temperature
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        return scores

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = self.processed(input_ids, scores)
        position = input_ids.size(1) - self.prompt_width
        uniform = counter_uniform(self.seeds.to(scores.device), position, scores.size(-1))
        return scores + (-torch.log(-torch.log(uniform))).to(scores.dtype)


# SplitMix64 (Steele, Lea and Flood 2014): output k of the stream seeded s is mix(s + k * GOLDEN), so any
# output is computed directly from (s, k). Constants as signed 64-bit integers; torch's int64 arithmetic
# wraps like the unsigned original, and the shifts below are made logical with a mask.
GOLDEN = 0x9E3779B97F4A7C15 - 2**64
MIX_1 = 0xBF58476D1CE4E5B9 - 2**64
MIX_2 = 0x94D049BB133111EB - 2**64


def counter_uniform(seeds: torch.Tensor, position: int, vocab: int) -> torch.Tensor:
    """Uniform float64 numbers in (0, 1), [rows, vocab]: element (r, v) is output position x vocab + v of
    row r's SplitMix64 stream, the same on every device and batch."""
    counters = torch.arange(vocab, dtype=torch.int64, device=seeds.device) + (position * vocab + 1)
    state = seeds[:, None] + counters[None, :] * GOLDEN
    state = (state ^ _shift_right(state, 30)) * MIX_1
    state = (state ^ _shift_right(state, 27)) * MIX_2
    state = state ^ _shift_right(state, 31)
    return (_shift_right(state, 11).double() + 0.5) / 2.0**53


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


@torch.no_grad()
def sample(
    model, prompts: list[list[int]], seeds: list[int], cfg, pad_id: int, eos_id, synced: bool, stops=None
):
    """Completion token ids, one list per prompt (ending at the end token when one was sampled), sampled
    per `cfg` (the grpo section) with each row's seed. Collective when `synced` (sharded weights).
    `stops`: a `StopStrings` that also ends a row at the first of its strings (the row's tokens through
    the one that completes it)."""
    width = max(map(len, prompts))
    processor = SeededSampling(seeds, cfg.temperature, cfg.top_k, cfg.top_p, width)
    return _generated(model, prompts, cfg.max_new_tokens, pad_id, eos_id, synced, stops, [processor])


@torch.no_grad()
def greedy(
    model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, eos_id, synced: bool, stops=None
):
    """`sample`'s completions decoded greedily (each row's most likely token at every step): no seeds."""
    return _generated(model, prompts, max_new_tokens, pad_id, eos_id, synced, stops, [])


def _generated(model, prompts, max_new_tokens, pad_id, eos_id, synced, stops, processors):
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding: every row's next token comes at the same column
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    criteria = [stops.criterion(width)] if stops else []
    generation = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id, eos_token_id=eos_id
    )
    with eager_blocks():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            generation_config=generation,
            logits_processor=LogitsProcessorList(processors),
            stopping_criteria=StoppingCriteriaList(criteria),
            synced_gpus=synced,
        )
    rows = [_until_end(row.tolist(), eos_id) for row in out[:, width:].cpu()]
    return [stops.cut(row) for row in rows] if stops else rows


class StopStrings:
    """Strings that end a completion where its text first holds one (a tool call's close): the same cut
    whatever else is in the batch, since a row is judged on its own tokens."""

    def __init__(self, strings: list[str], decode):
        self.strings, self.decode = strings, decode

    def __bool__(self) -> bool:
        return bool(self.strings)

    def found(self, tokens: list[int]) -> bool:
        text = self.decode(tokens)
        return any(s in text for s in self.strings)

    def cut(self, tokens: list[int]) -> list[int]:
        """`tokens` through the one that completes the first stop string (all of them when none does)."""
        if not self.found(tokens):
            return tokens
        return next(tokens[: i + 1] for i in range(len(tokens)) if self.found(tokens[: i + 1]))

    def criterion(self, prompt_width: int) -> StoppingCriteria:
        return _StopAt(self, prompt_width)


class _StopAt(StoppingCriteria):
    """generate's per-row stop: a row's new tokens (after `prompt_width`) hold one of `stops`' strings."""

    def __init__(self, stops: StopStrings, prompt_width: int):
        self.stops, self.prompt_width = stops, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        rows = input_ids[:, self.prompt_width :].tolist()
        return torch.tensor([self.stops.found(row) for row in rows], device=input_ids.device)


def _until_end(tokens: list[int], eos_id) -> list[int]:
    ends = set(eos_id if isinstance(eos_id, list) else [eos_id])
    for i, token in enumerate(tokens):
        if token in ends:
            return tokens[: i + 1]
    return tokens


@contextlib.contextmanager
def generating(accelerator, model, gather: bool):
    """The model to call `generate` on, and whether its calls are collective: under ZeRO-3 or FSDP2 (with
    `gather`) the whole model is gathered once here rather than layer by layer at every token; FSDP1 and
    ungathered sharded models generate in lockstep (synced)."""
    unwrapped = unwrap(accelerator, model)
    sharded = _is_zero3(accelerator) or accelerator.distributed_type == DistributedType.FSDP
    synced = sharded and accelerator.num_processes > 1
    was_training = unwrapped.training
    unwrapped.eval()
    try:
        if gather and _is_zero3(accelerator):
            with _zero3_gathered(model):
                yield unwrapped, False
        elif gather and _fsdp2_modules(unwrapped):
            with _fsdp2_unsharded(unwrapped):
                yield unwrapped, False
        else:
            with root_params_gathered(model):
                yield unwrapped, synced
    finally:
        unwrapped.train(was_training)


def _is_zero3(accelerator) -> bool:
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return False
    return accelerator.state.deepspeed_plugin.zero_stage == 3


@contextlib.contextmanager
def _zero3_gathered(engine):
    """Every ZeRO-3 partition gathered once, with the engine's fetch-and-release hooks off meanwhile (they
    would release each layer again after its forward)."""
    import deepspeed

    # A forward pass without gradients (an evaluation's) leaves some partitions fetched and the prefetch
    # trace mid-way; gathered on top of that, those layers run on empty weights. Every partition is
    # released first, so the gather starts from one known state.
    engine.empty_partition_cache()
    offload = engine.optimizer.parameter_offload if hasattr(engine.optimizer, "parameter_offload") else None
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        if offload is None:
            yield
            return
        for param in engine.module.parameters():
            param.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            coordinator = getattr(offload, "param_coordinator", None)
            if coordinator is not None and not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()
            offload._register_deepspeed_module(offload.module)


def _fsdp2_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def _fsdp2_unsharded(model):
    """Every FSDP2 unit unsharded once and kept so through the forward passes, then resharded. Each unit's
    own after-forward setting is put back as it was (the root's is false, the others' true): torch has a
    setter for it but no getter, so its state is saved and restored directly."""
    modules = _fsdp2_modules(model)
    saved = []
    for module in modules:
        state = module._get_fsdp_state()
        saved.append(
            (
                state,
                state._auto_reshard_after_forward,
                [g.post_forward_mesh_info for g in state._fsdp_param_groups],
            )
        )
        module.unshard()
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for module, (state, auto, infos) in zip(modules, saved):
            module.reshard()
            state._auto_reshard_after_forward = auto
            for group, info in zip(state._fsdp_param_groups, infos):
                group.post_forward_mesh_info = info
