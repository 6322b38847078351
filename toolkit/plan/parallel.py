"""Model-parallel layouts in `ftkit plan`: tensor parallelism (tp), FSDP2 over tensor-parallel ranks
(fsdp_tp), FSDP2's hybrid sharding (hsdp) and, for a mixture of experts, expert parallelism (ep), beside
the data-parallel backends of `plan.memory`.

    layout          split modules*   the rest**   gradients and optimizer states
    tp T            1/T              whole        follow their weights
    fsdp_tp D x T   1/(D x T)        1/D          follow their weights
    hsdp R x S      1/S              1/S          1/S
    ep E            routed experts 1/E, everything else whole (as under DDP); each GPU its own micro-batch

*  the attention q/k/v/o and MLP gate/up/down linears of every decoder layer and their LoRA adapters, as the
   model's transformers `base_model_tp_plan` names them (colwise and rowwise, Megatron-style).
** embeddings, norms and the output head (the chunked loss head needs it whole).
TP ranks run the same micro-batch: the residual stream is whole on each, the attention and MLP inner
activations are split T ways. FSDP gathers a layer across its D (or S) shards only. The pipelines are in
`plan.pipeline`, sequence parallelism in `plan.sequence`; they share this module's `Mesh` and `Layout`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from toolkit.plan import comm, engine, generation, memory
from toolkit.plan.footprint import MemoryEstimate
from toolkit.plan.memory import Precision
from toolkit.plan.request import PlanRequest

TP_STYLES = ("colwise", "rowwise")
"""The split styles ftkit's tensor parallelism applies."""


@dataclass(frozen=True)
class Mesh:
    """One layout's device mesh; the product of its sizes is the number of GPUs."""

    backend: str
    """tp | fsdp_tp | hsdp | ep | pp | pp_ddp | sp | sp_zero3 | sp_dp: its accelerate config file's name."""
    tp: int = 1
    shard: int = 1
    """FSDP shards (dp_shard)."""
    replicate: int = 1
    """Copies of the sharded model (HSDP's dp_replicate), of the whole pipeline (pp_ddp), or groups of sp GPUs
    that run different micro-batches (sp_dp)."""
    pp: int = 1
    """Pipeline stages, one process each (`plan.pipeline`)."""
    ep: int = 1
    """Processes a mixture of experts' routed experts are split over, each its own micro-batch."""
    sp: int = 1
    """Processes each sequence is split across (Ulysses sequence parallelism, `plan.sequence`)."""
    zero: str = ""
    """The ZeRO stage a sequence-parallel layout runs under: zero2 | zero3."""

    @property
    def gpus(self) -> int:
        return self.tp * self.shard * self.replicate * self.pp * self.ep * self.sp

    @property
    def data_parallel(self) -> int:
        """Groups of GPUs that run different micro-batches."""
        return self.shard * self.replicate * self.ep

    @property
    def label(self) -> str:
        if self.sp > 1:
            return f"{self.zero} + sp {self.sp}" + (f" x dp {self.replicate}" if self.replicate > 1 else "")
        if self.ep > 1:
            return f"ep {self.ep}"
        if self.pp > 1:
            return f"pp {self.pp}" + (f" x ddp {self.replicate}" if self.replicate > 1 else "")
        if self.backend == "tp":
            return f"tp {self.tp}"
        if self.backend == "fsdp_tp":
            return f"fsdp_tp {self.shard}x{self.tp}"
        return f"hsdp {self.replicate}x{self.shard}"


@dataclass(frozen=True)
class Layout:
    """A mesh's rows (one per checkpointing option), or why it has none."""

    mesh: Mesh
    refusal: str | None = None
    rows: tuple[MemoryEstimate, ...] = ()
    comm: tuple[int, ...] = ()
    """Bytes each GPU sends per optimizer step, one figure per row."""
    grad_accum: int = 0
    all_to_all: tuple[int, ...] = ()
    """Of `comm`, what sequence parallelism's all-to-alls send, one figure per row (sp layouts only)."""

    @property
    def label(self) -> str:
        return self.mesh.label


def meshes(gpus: int, experts: int = 0) -> list[Mesh]:
    """The layouts shown for `gpus` GPUs of one machine: tp across all of them; with an even count of 4 or
    more, fsdp_tp as dp_shard N/2 x tp 2 (TP stays on pairs of GPUs, whose traffic is the heaviest) and hsdp
    as 2 replicas of N/2 shards (one machine has no node boundary to replicate across); for a mixture of
    experts (`experts` a layer), ep across all of them."""
    if gpus < 2:
        return []
    found = [Mesh("tp", tp=gpus)]
    if gpus >= 4 and gpus % 2 == 0:
        found += [Mesh("fsdp_tp", tp=2, shard=gpus // 2), Mesh("hsdp", shard=gpus // 2, replicate=2)]
    return found + ([Mesh("ep", ep=gpus)] if experts else [])


def refusal(counts, mesh: Mesh) -> str | None:
    """Why `mesh` cannot split this model, in one line; None when it can."""
    if mesh.ep > 1:
        return _ep_refusal(counts, mesh.ep)
    if mesh.tp == 1:
        return None
    if not counts.tp_styles:
        return f"{counts.model_type} has no tensor-parallel plan in transformers (base_model_tp_plan)"
    other = [style for style in counts.tp_styles if style not in TP_STYLES]
    if other:
        styles = ", ".join(other)
        return f"{counts.model_type}'s tensor-parallel plan uses {styles}; ftkit splits colwise/rowwise"
    if counts.method == "qlora":
        return "QLoRA's 4-bit weights are not split by tensor parallelism"
    sizes = {
        "num_attention_heads": counts.heads,
        "num_key_value_heads": counts.kv_heads,
        "intermediate_size": counts.intermediate,
    }
    odd = [f"{name} {size}" for name, size in sizes.items() if size % mesh.tp]
    return f"tp {mesh.tp} does not divide {' or '.join(odd)}" if odd else None


def _ep_refusal(counts, ep: int) -> str | None:
    if counts.experts % ep:
        return f"ep {ep} does not divide the {counts.experts} experts a layer"
    if counts.method != "full":
        return f"{counts.method} adapts the experts, which ftkit does not split (lora.experts)"
    return None


def layouts(
    counts, request: PlanRequest, precision: Precision, ckpt_options, micro: int
) -> tuple[Layout, ...]:
    """Every layout for `request.gpus` GPUs at micro-batch `micro`, one row per checkpointing option."""
    found = []
    for mesh in meshes(request.gpus, counts.experts):
        why = refusal(counts, mesh)
        if why:
            found.append(Layout(mesh, why))
            continue
        rows = tuple(estimate(counts, mesh, request, precision, ckpt, micro) for ckpt in ckpt_options)
        sent = tuple(comm_bytes(counts, mesh, request, precision, micro, ckpt) for ckpt in ckpt_options)
        found.append(Layout(mesh, None, rows, sent, request.global_batch // (micro * mesh.data_parallel)))
    return tuple(found)


def ep_rank_counts(counts, ep: int):
    """The counts of what one process holds under expert parallelism: the routed experts 1/ep (full
    fine-tuning: trainable), the rest whole."""
    kept = counts.expert_params - math.ceil(counts.expert_params / ep)
    return dataclasses.replace(
        counts,
        total=counts.total - kept,
        trainable=counts.trainable - kept,
        expert_params=counts.expert_params - kept,
        # the share of the other processes' experts a token would have gone through here
        matmul_trainable=counts.matmul_trainable - kept * counts.experts_per_token // counts.experts,
        largest_layer=counts.largest_layer - kept // counts.layers,
    )


def rank_counts(counts, tp: int):
    """The counts of what one TP rank holds: the split modules' parameters 1/tp, the rest whole."""
    if tp == 1:
        return counts
    split = counts.tp_split_frozen + counts.tp_split_trainable
    frozen = _share(counts.frozen, counts.tp_split_frozen, tp)
    trainable = _share(counts.trainable, counts.tp_split_trainable, tp)
    return dataclasses.replace(
        counts,
        total=frozen + trainable,
        frozen=frozen,
        trainable=trainable,
        quantizable=_share(counts.quantizable, counts.tp_split_frozen, tp),
        matmul_frozen=_share(counts.matmul_frozen, counts.tp_split_frozen, tp),
        matmul_trainable=_share(counts.matmul_trainable, counts.tp_split_trainable, tp),
        largest_layer=_share(counts.largest_layer, split // counts.layers, tp),
    )


def _share(numel: int, split: int, tp: int) -> int:
    return numel - split + math.ceil(split / tp)


def estimate(
    counts, mesh: Mesh, request: PlanRequest, precision: Precision, ckpt: bool, micro: int
) -> MemoryEstimate:
    """One GPU under `mesh`: FSDP2's rules (`plan.memory`) applied to one TP rank's part of the model, with
    the attention and MLP activations split; every process still loads the whole model into CPU RAM."""
    # The data-parallel backend whose working copies, head and loading rules apply: FSDP's gathers when
    # there are shards, else DDP's whole weights (the states follow FSDP's rules at 1 shard: no DDP buckets).
    like = "fsdp" if mesh.shard > 1 else "ddp"
    rank = ep_rank_counts(counts, mesh.ep) if mesh.ep > 1 else rank_counts(counts, mesh.tp)
    sequences = micro * request.rows_per_example
    # Expert parallelism runs under DDP: its gradient buckets hold the replicated weights' gradients.
    states = (
        memory.model_state_bytes(rank, "ddp", mesh.gpus, precision)
        if mesh.ep > 1
        else memory.model_state_bytes(rank, "fsdp", mesh.shard, precision)
    )
    working = memory.working_weight_bytes(rank, like, precision)
    loss_head = memory.head_bytes(counts, request.row_tokens * sequences, like, precision, request.head)
    activations = loss_head + memory.activation_bytes(
        counts, request.row_tokens, sequences, ckpt, precision, request.lora_dropout, tp=mesh.tp
    )
    reference = _reference_bytes(rank, mesh, request, precision)
    tensors = states.total + working + activations + reference
    plan_round = request.generation_round()
    generating = None
    if plan_round is not None:
        generating = generation.estimate(
            rank, like, mesh.gpus, states, precision, plan_round, reference, mesh.data_parallel, mesh.tp
        )
    return MemoryEstimate(
        backend=mesh.backend,
        checkpointing=ckpt,
        micro_batch=micro,
        states=states,
        working=working,
        activations=activations,
        head=loss_head,
        overhead=memory.overhead_bytes(tensors, like, mesh.gpus, counts, precision),
        cpu_ram=memory.cpu_ram_bytes(counts, like, mesh.gpus, states, precision),
        reference=reference,
        generation=generating,
        engine=engine.training_gpu_bytes(counts, request, precision),
    )


def _reference_bytes(rank, mesh: Mesh, request: PlanRequest, precision: Precision) -> int:
    """A separate reference model's weights, split and sharded like the policy's."""
    if not request.reference_model:
        return 0
    return math.ceil(rank.total / mesh.shard) * (4 if precision.weights == "float32" else 2)


def comm_bytes(counts, mesh: Mesh, request: PlanRequest, precision: Precision, micro: int, ckpt: bool) -> int:
    """Bytes one GPU sends per optimizer step (`plan.comm`): tp's activation all-reduces, then FSDP's gathers
    and reduce-scatter over the shards of one TP rank's part; hsdp adds an all-reduce of each gradient shard
    across the replicas."""
    micro_batches = request.global_batch // (micro * mesh.data_parallel)
    if mesh.ep > 1:
        tokens = micro_batches * micro * request.rows_per_example * request.row_tokens
        return comm.ep_bytes(counts, mesh.ep, tokens, ckpt, precision)
    weights, grads = comm.fsdp_sizes(rank_counts(counts, mesh.tp), precision)
    sent = comm.fsdp_bytes(mesh.shard, micro_batches, weights, grads) if mesh.shard > 1 else 0
    if mesh.replicate > 1:
        sent += comm.all_reduce(mesh.replicate, math.ceil(grads / mesh.shard))
    if mesh.tp > 1:
        tokens = micro_batches * micro * request.rows_per_example * request.row_tokens
        sent += comm.tp_activation_bytes(counts, mesh.tp, tokens, ckpt, precision)
    return sent
