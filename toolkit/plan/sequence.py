"""Sequence-parallel layouts in `ftkit plan`: DeepSpeed's Ulysses attention (ALST) under ZeRO-2 or ZeRO-3, for
long sequences, beside the data-parallel backends of `plan.memory` and the layouts of `plan.parallel`.

    layout               config file                        ZeRO   GPUs a sequence is split over
    zero2 + sp N         accelerate_configs/sp.yaml         2      all N
    zero3 + sp N         accelerate_configs/sp_zero3.yaml   3      all N
    zero3 + sp 2 x dp D  accelerate_configs/sp_dp.yaml      3      2, in D = N / 2 groups (N even, 4 or more)

The sp GPUs of a group train on the same rows, each on seq / sp consecutive tokens of every sequence: the
embeddings, norms, MLP and loss head see only those tokens, and around attention an all-to-all trades the
sequence split for a head split (each GPU attends over the whole sequence with heads / sp heads) and another
trades it back. So a GPU's activations and loss head are those of seq / sp tokens (`memory.activation_bytes`
and `memory.head_bytes` at that length; the attention terms come to the same bytes split by heads), while
the model states follow the ZeRO stage's sharding over all the processes, as the zero rows do. Ulysses needs
sp to divide the attention heads, and the kv heads to divide sp or be divisible by it (DeepSpeed repeats kv
heads fewer than sp), and runs the SFT and preference recipes (the latter with the reference log-probs
precomputed before training, so no reference model is held while training). CPU RAM counts the whole model
loaded by every process first, under ZeRO-3 too: an upper bound where ZeRO-3 builds the model sharded.
Traffic: ZeRO's collectives over all processes for the step's micro-batches, each of seq / sp tokens a
sequence, plus the all-to-alls (`comm.ulysses_bytes`).
"""

from __future__ import annotations

import dataclasses
import math

from toolkit.plan import comm, memory
from toolkit.plan.footprint import MemoryEstimate
from toolkit.plan.memory import Precision
from toolkit.plan.parallel import Layout, Mesh
from toolkit.plan.request import PlanRequest


def meshes(gpus: int) -> list[Mesh]:
    """sp across all `gpus` under ZeRO-2 and ZeRO-3; with an even count of 4 or more also sp 2 x dp N/2 under
    ZeRO-3 (the all-to-alls stay on pairs of GPUs)."""
    if gpus < 2:
        return []
    found = [Mesh("sp", sp=gpus, zero="zero2"), Mesh("sp_zero3", sp=gpus, zero="zero3")]
    if gpus >= 4 and gpus % 2 == 0:
        found.append(Mesh("sp_dp", sp=2, replicate=gpus // 2, zero="zero3"))
    return found


def refusal(counts, mesh: Mesh, request: PlanRequest) -> str | None:
    """Why `mesh` cannot split this model's sequences, in one line; None when it can."""
    if request.objective == "grpo":
        return "sequence parallelism runs the SFT and preference recipes; grpo is refused"
    if counts.recurrent:
        return f"its {counts.recurrent} layers carry a state that a slice of the sequence cannot hand on"
    if counts.heads % mesh.sp:
        return f"sp {mesh.sp} does not divide num_attention_heads {counts.heads} (Ulysses splits the heads)"
    if counts.kv_heads % mesh.sp and mesh.sp % counts.kv_heads:
        return f"sp {mesh.sp} and num_key_value_heads {counts.kv_heads}: neither divides the other"
    return None


def layouts(
    counts, request: PlanRequest, precision: Precision, ckpt_options, micro: int
) -> tuple[Layout, ...]:
    """Every sequence-parallel layout for `request.gpus` GPUs at micro-batch `micro`, one row per
    checkpointing option."""
    found = []
    for mesh in meshes(request.gpus):
        why = refusal(counts, mesh, request)
        if why:
            found.append(Layout(mesh, why))
            continue
        rows = tuple(estimate(counts, mesh, request, precision, ckpt, micro) for ckpt in ckpt_options)
        micro_batches = request.global_batch // (micro * mesh.data_parallel)
        a2a = tuple(all_to_all_bytes(counts, mesh, request, precision, micro, ckpt) for ckpt in ckpt_options)
        zero = comm.data_parallel_bytes(counts, mesh.zero, mesh.gpus, micro_batches, precision)
        sent = tuple(zero + part for part in a2a)
        found.append(Layout(mesh, None, rows, sent, micro_batches, all_to_all=a2a))
    return tuple(found)


def local_tokens(tokens: int, sp: int) -> int:
    """Tokens of a sequence one GPU holds: its slice of `tokens` (padded to a multiple of sp)."""
    return math.ceil(tokens / sp)


def estimate(
    counts, mesh: Mesh, request: PlanRequest, precision: Precision, ckpt: bool, micro: int
) -> MemoryEstimate:
    """One GPU of `mesh`: the ZeRO stage's row over all the processes (`memory.estimate`) at seq / sp tokens a
    sequence, every process loading the whole model first (an upper bound on CPU RAM)."""
    row = memory.estimate(
        counts,
        mesh.zero,
        mesh.gpus,
        local_tokens(request.row_tokens, mesh.sp),
        micro,
        ckpt,
        precision,
        request.lora_dropout,
        sequences_per_example=request.rows_per_example,
        head=request.head,
        offload=request.activation_offload,
        zero3_init=False,
    )
    return dataclasses.replace(row, backend=mesh.backend)


def all_to_all_bytes(
    counts, mesh: Mesh, request: PlanRequest, precision: Precision, micro: int, ckpt: bool
) -> int:
    """Bytes the all-to-alls of one GPU of `mesh` send per optimizer step (`comm.ulysses_bytes`)."""
    micro_batches = request.global_batch // (micro * mesh.data_parallel)
    sequences = micro_batches * micro * request.rows_per_example
    tokens = sequences * local_tokens(request.row_tokens, mesh.sp)
    return comm.ulysses_bytes(counts, mesh.sp, tokens, ckpt, precision)
