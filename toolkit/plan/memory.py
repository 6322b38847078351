"""Memory one GPU needs to train a model under each shipped backend: model states, activations, overhead.

Model states (parameters, gradients, AdamW states, fp32 master weights) are exact byte counts of what each
backend keeps per rank; activations and overhead are estimates (formulas in their docstrings). Sharding:

    backend         parameters   gradients    optimizer states (and master weights)
    single / ddp    full         full         full          (DDP keeps a second gradient copy in its buckets)
    zero1           full         full         1/N
    zero2           full         1/N          1/N
    zero3, fsdp     1/N          1/N          1/N
    zero3_offload   1/N          1/N          1/N           all of it in CPU RAM instead of GPU memory

The model-parallel layouts (tp, fsdp_tp, hsdp) are in `plan.parallel`, the pipelines (pp, pp x ddp) in
`plan.pipeline`, sequence parallelism (ZeRO + sp) in `plan.sequence`; what each backend sends between GPUs
is in `plan.comm`; GRPO's generation phase is in `plan.generation`; the records these formulas fill
(`ModelStateBytes`, `MemoryEstimate`) are in `plan.footprint`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from toolkit.config import LossConfig
from toolkit.launch.machine import GIB
from toolkit.plan.footprint import NO_IMAGES, ImageBytes, MemoryEstimate, ModelStateBytes

BACKENDS = ("single", "ddp", "fsdp", "zero1", "zero2", "zero3", "zero3_offload")
DEEPSPEED = ("zero1", "zero2", "zero3", "zero3_offload")
SHARDED_PARAMS = ("fsdp", "zero3", "zero3_offload")
# bitsandbytes NF4 with double quantisation: 4 bits a weight, an 8-bit absmax per block of 64 weights and an
# fp32 absmax per 256 of those blocks.
QLORA_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
# A mixture of experts' fused experts under QLoRA (toolkit/model/quant_experts.py): 4 bits a weight and an
# fp32 scale per block of 64.
EXPERT_BYTES_PER_PARAM = 0.5 + 4 / 64
CUDA_CONTEXT = GIB // 2
"""CUDA context, cuBLAS workspaces and kernels loaded on each GPU before the first tensor."""
NCCL_BUFFERS = GIB // 2
"""NCCL communicator buffers on each GPU when there is more than one process."""
FRAGMENTATION = 0.10
"""Share of tensor memory the caching allocator loses to fragmentation."""
PROCESS_RAM = 2 * GIB
"""CPU RAM of one training process before it loads a model (Python, torch, CUDA libraries, data)."""
ATTENTION = "attention"
"""A decoder layer's softmax attention in `ModelCounts.mixers` (a recurrent mixer goes by its kind's name)."""


@dataclass(frozen=True)
class Precision:
    weights: str = "float32"
    """float32 | bfloat16: dtype the model is loaded in (the recipe's model.dtype)."""
    mixed: str = "no"
    """no | bf16: autocast (the recipe's train.mixed_precision); DeepSpeed then keeps bf16 weights."""


FP32 = Precision()


@dataclass(frozen=True)
class Head:
    """How the loss reads the output head: the recipe's loss section, and what the objective asks of it."""

    kind: str = LossConfig.head
    """auto | chunked | full (loss.head)."""
    chunk_tokens: int = LossConfig.chunk_tokens
    """Label tokens the chunked head scores at once (loss.chunk_tokens)."""
    log_probs: bool = False
    """Per-token log-probs (preference tuning): the chunk is recomputed in backward, nothing V-sized kept."""


def model_state_bytes(counts, backend: str, n_ranks: int, precision: Precision = FP32) -> ModelStateBytes:
    """Exact bytes of parameters, gradients and optimizer states on one rank (rank 0: shards are rounded up).

    `counts` is a `plan.counts.ModelCounts`; the rules follow what each backend allocates (checked on CPU
    against a walk of live tensors under every backend, within 1% for full fine-tuning and 4% for LoRA of a
    3M-parameter model). Not counted: AdamW's scalar step counters, shard alignment padding, and DeepSpeed's
    reduce buckets (hidden^2 elements each; `overhead_bytes` has them).
    """
    ranks = 1 if backend == "single" else n_ranks
    frozen_b, train_b = param_bytes(counts.method, backend, precision)
    zero3 = backend in ("zero3", "zero3_offload")

    def shard(numel: int, sharded: bool = True) -> int:
        return math.ceil(numel / ranks) if sharded else numel

    params_sharded = backend in SHARDED_PARAMS
    frozen = shard(counts.frozen, params_sharded) * frozen_b
    if counts.method == "qlora":
        unquantized = (
            shard(counts.frozen - counts.quantizable - counts.expert_params, params_sharded) * frozen_b
        )
        frozen = math.ceil(shard(counts.quantizable, params_sharded) * QLORA_BYTES_PER_PARAM) + unquantized
        frozen += math.ceil(shard(counts.expert_params, params_sharded) * EXPERT_BYTES_PER_PARAM)
    grad_numel = shard(counts.trainable, backend not in ("single", "ddp", "zero1"))
    # Offloaded ZeRO-3 keeps a second, fp32 gradient buffer in CPU RAM for the CPU Adam step.
    grad_b = train_b + 4 if backend == "zero3_offload" else train_b
    optim_numel = shard(counts.trainable, backend not in ("single", "ddp"))
    deepspeed = backend in DEEPSPEED
    return ModelStateBytes(
        frozen=frozen,
        trainable=shard(counts.trainable, params_sharded) * train_b,
        persistent=counts.zero3_persistent * train_b if zero3 else 0,
        grads=grad_numel * grad_b,
        grad_buckets=counts.trainable * train_b if backend == "ddp" else 0,
        optimizer=optim_numel * (8 if deepspeed else 2 * train_b),
        master=optim_numel * 4 if deepspeed else 0,
        grads_persist=zero3,
        in_cpu_ram=backend == "zero3_offload",
    )


def param_bytes(method: str, backend: str, precision: Precision) -> tuple[int, int]:
    """Bytes per (frozen, trainable) parameter as the backend stores them.

    DeepSpeed under bf16 casts every parameter to bf16 and keeps fp32 masters; peft keeps adapters in fp32
    over a bf16 base. QLoRA's unquantized parameters (embeddings, norms) stay in the weights' dtype
    (`quant.keep_bf16_stream`).
    """
    if backend in DEEPSPEED and precision.mixed == "bf16":
        return 2, 2
    weights = 2 if precision.weights == "bfloat16" else 4
    return weights, 4 if method in ("lora", "qlora") else weights


def activation_bytes(
    counts,
    seq_len: int,
    micro_batch: int,
    checkpointing: bool,
    precision: Precision,
    lora_dropout: float = 0.0,
    tp: int = 1,
) -> int:
    """Activation memory of one micro-batch at the peak of the backward pass (an estimate).

    Adapted from the per-layer count of Korthikanti et al., "Reducing Activation Recomputation in Large
    Transformer Models" (2022): 34sbh + 5as^2b bytes for a GPT layer with 16-bit activations. For a
    Llama-style layer (no dropout, SDPA/flash attention that keeps no s x s scores, SwiGLU MLP of width i,
    RMSNorm that upcasts to fp32), in bytes per token, with e bytes per activation (2 under bf16, else 4),
    hidden h, attention width h_a = heads x head_dim and a heads:

        each RMSNorm (2 a layer)  4h + 2eh        fp32 copy of its input, normalised x, its output
        attention                 5e*h_a + 4a     q, k and v (repeated to every head), the SDPA output and its
                                                  contiguous copy for o_proj; fp32 log-sum-exp per head
        recurrent mixer           e*c + 4f        what its kind keeps (toolkit/model/families.py, Kept):
                                                  c compute-dtype and f fp32 elements, no s x s scores
        SwiGLU MLP                4e*i            gate, up, SiLU(gate), and their product
        mixture of experts        2ekh + 8E       the token's k copies sent to its experts and their outputs
                                                  before the weighted sum; fp32 router logits and
                                                  probabilities over the E experts. Its i is the width the
                                                  token spans: k experts' (and a shared expert's)
        LoRA dropout (p > 0)      (e+1)(5h+h_a+i) a dropped copy of each adapted input, with its 1-byte mask
                                                  (a recurrent mixer's: 2h + its output projection's input)
    A hybrid's layers each count their own mixer (an attention layer attention, a gated DeltaNet layer its
    own); a family whose MLPs are layers of their own (Nemotron-H) has one norm and no MLP in its mixer
    layers. The head adds one RMSNorm (the loss head's own memory is `head_bytes`). With gradient
    checkpointing only each layer's input is kept (r bytes per h, r the weights' dtype size: the residual
    stream's dtype), plus the largest layer being recomputed.
    Under tensor parallelism of size `tp` (which divides the heads and i) the attention and MLP terms and the
    dropped inputs of o_proj and down_proj are split tp ways; the norms, the residual stream and the
    recurrent mixers stay whole.
    Total = s x b x per-token bytes.
    """
    layer, kept, norm = token_activation_bytes(counts, precision, lora_dropout, tp)
    if checkpointing:
        stored = counts.layers * kept + layer
    else:
        stored = stack_activation_bytes(counts, precision, lora_dropout, tp)
    return (stored + norm) * seq_len * micro_batch


def token_activation_bytes(
    counts, precision: Precision, lora_dropout: float = 0.0, tp: int = 1
) -> tuple[int, int, int]:
    """Per token, as `activation_bytes` counts them: (the largest decoder layer's activations, what
    checkpointing keeps of a layer, one RMSNorm's)."""
    e = compute_bytes(precision)
    norm = 4 * counts.hidden + 2 * e * counts.hidden
    kinds = set(getattr(counts, "mixers", ())) or {(ATTENTION,)}
    largest = max(_layer_bytes(counts, mixers, e, lora_dropout, tp) for mixers in kinds)
    return largest, residual_bytes(counts, precision) * counts.hidden, norm


def stack_activation_bytes(counts, precision: Precision, lora_dropout: float = 0.0, tp: int = 1) -> int:
    """Per token, every decoder layer's activations (without checkpointing)."""
    e = compute_bytes(precision)
    kinds = Counter(layer_mixers(counts))
    return sum(n * _layer_bytes(counts, mixers, e, lora_dropout, tp) for mixers, n in kinds.items())


def layer_mixers(counts) -> tuple[tuple[str, ...], ...]:
    """Each decoder layer's sequence mixers as the plan counts them (`ModelCounts.mixers`); a shape without
    them (a vision tower's block) is attention and an MLP in every layer."""
    return getattr(counts, "mixers", ()) or ((ATTENTION,),) * counts.layers


def _layer_bytes(counts, mixers: tuple[str, ...], e: int, lora_dropout: float, tp: int) -> int:
    """One decoder layer's activations per token, `mixers` its sequence mixers (see `activation_bytes`)."""
    h, h_a, i = counts.hidden, counts.heads * counts.head_dim, counts.intermediate
    attention = ATTENTION in mixers
    mlp = not mixers or not getattr(counts, "mlp_alone", False)
    whole = (4 * h + 2 * e * h) * (bool(mixers) + mlp)
    split = (5 * e * h_a + 4 * counts.heads) * attention + 4 * e * i * mlp
    dropped, dropped_split = 3 * h * attention + 2 * h * mlp, h_a * attention + i * mlp
    kept = dict(getattr(counts, "recurrent_kept", ()))
    for name in mixers:
        if name in kept:
            compute, fp32, inner = kept[name]
            whole += e * compute + 4 * fp32
            dropped += 2 * h + inner
    if counts.experts and mlp:
        whole += 2 * e * counts.experts_per_token * h + 8 * counts.experts
    layer = whole + split // tp
    if counts.method != "full" and lora_dropout > 0:
        layer += (e + 1) * (dropped + dropped_split // tp)
    return layer


def residual_bytes(counts, precision: Precision) -> int:
    """Bytes of one element of the residual stream (the hidden states between decoder layers): the weights'
    dtype (QLoRA's too: its embeddings and norms keep it)."""
    return 4 if precision.weights == "float32" else 2


def full_logits(counts, head: Head) -> bool:
    """Whether the loss reads the whole logits: loss.head full, or auto on a model the chunked head cannot
    follow."""
    return head.kind == "full" or (head.kind == "auto" and not counts.head_chunks)


def head_bytes(counts, tokens: int, backend: str, precision: Precision, head: Head) -> int:
    """The loss head's memory for one micro-batch of `tokens` label tokens (every token counted as a label).

    full: the logits, their fp32 copy and the log-softmax or its gradient, e + 8 bytes per vocabulary entry
    per token. chunked, c = min(chunk_tokens, tokens) tokens at a time, V the vocabulary: a c x V fp32 chunk
    plus its gradient cast to the compute dtype (none when that is fp32). Training (SFT) computes the
    gradient in forward and keeps the hidden states' gradient (tokens x hidden x e) and, when the head is
    trained, a gradient of the head weight; log-probs (preference) keep nothing and recompute the chunk in
    backward. Eval and reference log-probs (c x V x 4, no gradient) stay below either peak.
    """
    e = compute_bytes(precision)
    if full_logits(counts, head):
        return tokens * counts.vocab * (e + 8)
    chunk = min(head.chunk_tokens, tokens) * counts.vocab
    if head.log_probs:
        return chunk * (4 + e)
    return chunk * (4 + (0 if e == 4 else e)) + head_kept_bytes(counts, tokens, backend, precision, head)


def head_kept_bytes(counts, tokens: int, backend: str, precision: Precision, head: Head) -> int:
    """Of `head_bytes`, what one micro-batch keeps from its forward until its backward (a pipeline's GPipe
    holds it for every micro-batch): the full head's fp32 log-softmax, the chunked head's gradients computed
    in forward (SFT), nothing for log-probs."""
    if full_logits(counts, head):
        return tokens * counts.vocab * 4
    if head.log_probs:
        return 0
    kept = tokens * counts.hidden * compute_bytes(precision)
    if counts.method == "full":
        # The head weight's gradient is computed in forward, so it exists before backward allocates .grad.
        kept += counts.vocab * counts.hidden * _head_weight_bytes(counts, backend, precision)
    return kept


def compute_bytes(precision: Precision) -> int:
    """Bytes of an activation: 2 under bf16 autocast or bf16 weights, else 4."""
    return 2 if precision.mixed == "bf16" or precision.weights == "bfloat16" else 4


def _head_weight_bytes(counts, backend: str, precision: Precision) -> int:
    """Bytes of a head weight as the forward sees it: gathered in the compute dtype when sharded."""
    if backend in SHARDED_PARAMS:
        return compute_bytes(precision)
    return param_bytes(counts.method, backend, precision)[1]


def working_weight_bytes(counts, backend: str, precision: Precision) -> int:
    """Weights that exist only while computing (an estimate).

    Sharded backends gather whole layers in the compute dtype: two decoder layers (one computing, one
    prefetched) plus the embedding or output head, whichever is larger. Under bf16 autocast, fp32 weights on
    an unsharded torch backend get bf16 copies of every linear weight that live until the backward pass.
    """
    compute = compute_bytes(precision)
    if backend in SHARDED_PARAMS:
        return (2 * counts.largest_layer + max(counts.embed, counts.lm_head)) * compute
    autocast_copies = (
        precision.mixed == "bf16" and precision.weights == "float32" and counts.method != "qlora"
    )
    if backend in ("single", "ddp") and autocast_copies:
        # A mixture of experts' kernels cast a layer's whole experts tensor, not the share a token uses.
        return 2 * (counts.matmul_frozen + counts.matmul_trainable + _unused_experts(counts))
    return 0


def _unused_experts(counts) -> int:
    """Expert weights a token is not routed to (0 for a dense model)."""
    if not counts.experts:
        return 0
    return counts.expert_params - counts.expert_params * counts.experts_per_token // counts.experts


def overhead_bytes(tensor_bytes: int, backend: str, n_gpus: int, counts, precision: Precision) -> int:
    """CUDA context + NCCL buffers (more than one GPU) + ZeRO's two reduce buckets (reduce_bucket_size "auto"
    is hidden^2 elements, two of them with overlap_comm) + allocator fragmentation on the tensors."""
    comm = NCCL_BUFFERS if backend != "single" and n_gpus > 1 else 0
    if backend in DEEPSPEED:
        comm += 2 * counts.hidden**2 * param_bytes(counts.method, backend, precision)[1]
    return CUDA_CONTEXT + comm + int(FRAGMENTATION * tensor_bytes)


def cpu_ram_bytes(
    counts, backend: str, n_gpus: int, states: ModelStateBytes, precision: Precision, zero3_init: bool = True
) -> int:
    """CPU RAM of the whole machine: each process's own footprint, plus the larger of loading the model and
    holding offloaded states. Every process loads the full model into RAM first, except ZeRO-3 with
    `zero3_init` (zero3_init_flag: each keeps its shard) and QLoRA (quantized straight onto its GPU, but for
    a mixture of experts' fused experts, which each process holds in RAM in 16-bit until they are
    quantized)."""
    procs = 1 if backend == "single" else n_gpus
    base = counts.frozen if counts.method != "full" else counts.total
    weight_b = 2 if precision.weights == "bfloat16" else 4
    sharded_init = zero3_init and backend in ("zero3", "zero3_offload")
    if counts.method == "qlora":  # a mixture of experts' experts load to RAM in 16-bit, then go 4-bit
        loading = 0 if sharded_init else procs * counts.expert_params * 2
    elif sharded_init:
        loading = base * weight_b
    else:
        loading = procs * base * weight_b
    offloaded = procs * (states.total - states.persistent) if states.in_cpu_ram else 0
    return procs * PROCESS_RAM + max(loading, offloaded)


def qlora_load_bytes(counts) -> int:
    """One whole 4-bit base with its unquantized parameters in bf16: what each process holds while loading
    before a sharded backend splits it (ftkit loads a full copy per process; a mixture of experts' experts
    reach the GPU in 4-bit)."""
    experts = math.ceil(counts.expert_params * EXPERT_BYTES_PER_PARAM)
    unquantized = counts.frozen - counts.quantizable - counts.expert_params
    return math.ceil(counts.quantizable * QLORA_BYTES_PER_PARAM) + experts + 2 * unquantized


def estimate(
    counts,
    backend: str,
    n_gpus: int,
    seq_len: int,
    micro_batch: int,
    checkpointing: bool,
    precision: Precision,
    lora_dropout: float = 0.0,
    sequences_per_example: int = 1,
    reference: int = 0,
    head: Head | None = Head(),
    offload: bool = False,
    accumulation: int | None = None,
    zero3_init: bool = True,
    images: ImageBytes = NO_IMAGES,
    pair_loss: int = 0,
) -> MemoryEstimate:
    """Everything one GPU (and the machine's RAM) needs for `backend` on `n_gpus` GPUs; preference tuning
    runs 2 `sequences_per_example` (chosen and rejected) and may hold `reference` bytes of frozen weights.
    With `offload` (train.activation_offload) the activations wait in CPU RAM and the GPU holds one layer's
    (the layer computing, or being recomputed) besides the loss head's. `accumulation` is the micro-batches a
    step (None: assume several); with one, on single or DDP, gradients and activations do not peak together
    (`MemoryEstimate.grads_meet_activations`). `zero3_init`: see `cpu_ram_bytes`. `images`: a
    vision-language model's micro-batch of images (`plan.images`). `head` None: a model without an LM
    head (the embedding recipe), whose loss holds `pair_loss` bytes instead (`plan.embedding`)."""
    states = model_state_bytes(counts, backend, n_gpus, precision)
    working = working_weight_bytes(counts, backend, precision)
    sequences = micro_batch * sequences_per_example
    loss_head = (
        pair_loss if head is None else head_bytes(counts, seq_len * sequences, backend, precision, head)
    )
    activations = activation_bytes(counts, seq_len, sequences, checkpointing, precision, lora_dropout)
    offloaded = 0
    if offload:
        layer, _, norm = token_activation_bytes(counts, precision, lora_dropout)
        offloaded = max(activations - (layer + norm) * seq_len * sequences, 0)
        activations -= offloaded
    activations += loss_head
    image_share = max(images.kept, images.peak - activations)  # the tower's peak meets none of the rest
    activations += image_share
    tensors = (states.persistent if states.in_cpu_ram else states.total) + working + activations + reference
    meet = accumulation is None or accumulation > 1 or backend not in ("single", "ddp")
    if not meet:
        tensors -= min(states.grads, activations)
    return MemoryEstimate(
        backend=backend,
        checkpointing=checkpointing,
        micro_batch=micro_batch,
        states=states,
        working=working,
        activations=activations,
        head=loss_head,
        overhead=overhead_bytes(tensors, backend, n_gpus, counts, precision),
        cpu_ram=cpu_ram_bytes(counts, backend, n_gpus, states, precision, zero3_init)
        + (1 if backend == "single" else n_gpus) * offloaded,
        reference=reference,
        images=image_share,
        grads_meet_activations=meet,
    )
