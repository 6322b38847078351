"""Bytes each GPU sends per optimizer step, by backend. Ring collectives: to all-gather or reduce-scatter
over n ranks each rank sends (n-1)/n of the whole tensor, to all-reduce twice that.

    ddp      all-reduce of the gradients, once a step (accumulation runs under no_sync)
    zero1    reduce-scatter of the gradients and all-gather of the updated weights, once a step
    zero2    the same, but DeepSpeed reduces the gradients after every micro-batch
    fsdp     all-gather of every weight in forward and again in backward, every micro-batch; reduce-scatter
             of the gradients once a step (FSDP2 skips it while accumulating)
    zero3    the same gathers, and a reduce-scatter after every micro-batch
    tp       2 all-reduces of the activations (micro-batch x seq x hidden) per decoder layer in forward and 2
             in backward, every micro-batch; checkpointing repeats the forward's 2 when it recomputes
    pp       per micro-batch, every stage boundary carries the hidden states forward (micro-batch x seq x
             hidden, with the position ids, mask and labels riding along) and their gradient back, each
             sent by one GPU: a middle stage sends 2, the first and the last 1; interleaved, each of a GPU's
             chunks sends to its neighbours. pp x ddp adds an all-reduce of each stage's gradients across the
             copies, once a step
    sp       Ulysses sequence parallelism over sp GPUs: per attention layer 4 all-to-alls in forward (q, k, v
             in; the output back), 4 in backward, and checkpointing repeats the forward's, every micro-batch;
             each sends (sp-1)/sp of the GPU's local tensors (seq/sp tokens). Beside them, ZeRO's collectives
             over all the processes
Weights travel as the backend gathers them (FSDP2's param_dtype, the compute dtype under bf16 autocast;
DeepSpeed's stored dtype), gradients as it reduces them, activations in the compute dtype (the pipeline's
hidden states in the residual stream's). Small tensors ZeRO-3 keeps whole are counted as gathered.
"""

from __future__ import annotations

import math

from toolkit.plan.memory import (
    QLORA_BYTES_PER_PARAM,
    Precision,
    compute_bytes,
    model_state_bytes,
    param_bytes,
)


def gather(ranks: int, size: int) -> int:
    """Bytes one rank sends to all-gather or reduce-scatter `size` bytes over `ranks` ranks."""
    return (ranks - 1) * size // ranks


def all_reduce(ranks: int, size: int) -> int:
    """Bytes one rank sends to all-reduce `size` bytes over `ranks` ranks (reduce-scatter, then gather)."""
    return 2 * (ranks - 1) * size // ranks


def ep_bytes(counts, ep: int, tokens: int, checkpointing: bool, precision: Precision) -> int:
    """Bytes one GPU sends per optimizer step under expert parallelism over `ep` GPUs, for `tokens` of its
    own: each MoE layer sends each token's copies for its k experts out and their results back (forward,
    the recomputed forward under checkpointing, backward twice), the share (ep - 1) / ep leaving the GPU;
    then DDP's all-reduce of the replicated weights' gradients."""
    act = 2 if precision.mixed == "bf16" or precision.weights == "bfloat16" else 4
    passes = 4 + (2 if checkpointing else 0)
    per_layer = tokens * counts.experts_per_token * counts.hidden * act * passes * (ep - 1) // ep
    replicated = counts.trainable - counts.expert_params if counts.method == "full" else counts.trainable
    grads = replicated * param_bytes(counts.method, "ddp", precision)[1]
    return counts.layers * per_layer + all_reduce(ep, grads)


def ulysses_bytes(counts, sp: int, tokens: int, checkpointing: bool, precision: Precision) -> int:
    """Bytes one GPU sends per optimizer step for Ulysses' all-to-alls over `sp` GPUs, `tokens` being its own
    slices of the sequences it runs in that step. Per token and attention layer it sends q and the output
    (heads x head_dim each) and k and v (kv heads x head_dim each; DeepSpeed repeats fewer kv heads than sp
    until there are sp), the share (sp - 1) / sp leaving the GPU, in forward, backward and the recomputed
    forward under checkpointing."""
    kv_heads = counts.kv_heads * max(1, sp // counts.kv_heads)
    width = 2 * (counts.heads + kv_heads) * counts.head_dim
    passes = 3 if checkpointing else 2
    per_layer = tokens * width * compute_bytes(precision) * (sp - 1) // sp
    return counts.layers * passes * per_layer


def data_parallel_bytes(counts, backend: str, n_gpus: int, micro_batches: int, precision: Precision) -> int:
    """Bytes one GPU sends per optimizer step of `micro_batches` micro-batches under `backend`."""
    if backend == "single":
        return 0
    if backend == "fsdp":
        weights, grads = fsdp_sizes(counts, precision)
        return fsdp_bytes(n_gpus, micro_batches, weights, grads)
    grads = counts.trainable * param_bytes(counts.method, backend, precision)[1]
    if backend == "ddp":
        return all_reduce(n_gpus, grads)
    if backend == "zero1":
        return gather(n_gpus, 2 * grads)
    if backend == "zero2":
        return gather(n_gpus, (micro_batches + 1) * grads)
    whole = model_state_bytes(counts, backend, 1, precision)
    return gather(n_gpus, micro_batches * (2 * (whole.frozen + whole.trainable) + grads))


def fsdp_bytes(shards: int, micro_batches: int, weights: int, grads: int) -> int:
    """FSDP2 over `shards` ranks: two gathers of `weights` a micro-batch, one reduce-scatter of `grads`."""
    return gather(shards, 2 * micro_batches * weights) + gather(shards, grads)


def fsdp_sizes(counts, precision: Precision) -> tuple[int, int]:
    """(weights, gradients) in bytes that FSDP2 gathers and reduces for `counts` (one TP rank's part of the
    model under fsdp_tp). bf16 autocast gathers and reduces in bf16; QLoRA's 4-bit weights go as stored."""
    frozen_b, train_b = (2, 2) if precision.mixed == "bf16" else param_bytes(counts.method, "fsdp", precision)
    weights = counts.frozen * frozen_b
    if counts.method == "qlora":
        quantized = math.ceil(counts.quantizable * QLORA_BYTES_PER_PARAM)
        weights = quantized + (counts.frozen - counts.quantizable) * frozen_b
    return weights + counts.trainable * train_b, counts.trainable * train_b


def tp_activation_bytes(counts, tp: int, tokens: int, checkpointing: bool, precision: Precision) -> int:
    """Bytes one GPU sends per step for tensor parallelism's activation all-reduces, its group running
    `tokens` tokens a step."""
    per_layer = 6 if checkpointing else 4
    size = counts.layers * per_layer * tokens * counts.hidden * compute_bytes(precision)
    return all_reduce(tp, size)


def pipeline_bytes(
    stages: int, chunks: int, index: int, micro_batches: int, forward: int, backward: int
) -> int:
    """Bytes process `index` of a pipeline of `stages` processes sends per step of `micro_batches`: `forward`
    bytes from each chunk that has a next one, `backward` bytes (the gradient) from each that has a previous
    one. It holds chunks index + k x stages (k < chunks, torch.distributed.pipelining's loop order)."""
    last = stages * chunks - 1
    held = range(index, last + 1, stages)
    sends = sum(forward for chunk in held if chunk < last) + sum(backward for chunk in held if chunk > 0)
    return sends * micro_batches
