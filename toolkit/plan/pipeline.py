"""Pipeline-parallel layouts in `ftkit plan`: pp P (P processes, one stage each) and pp P x ddp D (D copies of
that pipeline, P x D GPUs), beside the tensor-parallel layouts of `plan.parallel`, as `toolkit.pipeline` runs
them.

The split is the runtime's (`toolkit.pipeline.stages`): consecutive decoder layers balanced by parameter
count, the first stage also holding the input embeddings, the last the final norm and the output head, where
the loss is computed; what it refuses (tied embeddings, model types it does not split, QLoRA, a separate
reference model) has no rows. A copy trains on global_batch / D examples a step: m = global_batch /
(micro x D) micro-batches of micro rows (2 x micro under DPO: chosen and rejected) x seq tokens (seq rounded
up to 8, the runtime's fixed shape) through one schedule step.

Per GPU, the largest of the P (the worst GPU):
    model states   `plan.memory`'s per-parameter costs for its stages' parameters (full or LoRA); under
                   pp x ddp the flat copy of the gradients the copies all-reduce, where it outgrows the
                   activations and autocast copies the backward has freed by then
    activations    k micro-batches in flight on GPU i, each holding its layers' activations as
                   `memory.activation_bytes` counts them (with checkpointing each layer's input), plus one
                   layer recomputed under checkpointing:
                     gpipe              k = m on every GPU (all forwards, then all backwards)
                     1f1b               k = min(m, P - i): GPU 0 holds the most, P
                     interleaved_1f1b   k = min(m, (P - i)(1 + (P - 1)/(P v))) with v chunks a GPU: the 1f1b
                                        amount times the factor Korthikanti et al. (2022) give for it
                   The last GPU adds the loss head of one micro-batch (`memory.head_bytes`); under gpipe
                   also what the head keeps from forward to backward (`memory.head_kept_bytes`) for each of
                   the other m - 1.
    bubble         the idle share of each GPU: (P - 1)/(m + P - 1); interleaved (P - 1)/(v m + P - 1)
    comm           per micro-batch, each boundary of a GPU's chunks: the hidden states forward (in the
                   residual stream's dtype, with the position ids, mask and labels that ride along) or their
                   gradient back (`comm.pipeline_bytes`); under pp x ddp also the all-reduce of its stage's
                   gradients across the D copies. The busiest GPU is shown.
CPU RAM is DDP's: every process loads the whole model before keeping its stages.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import get_args

from toolkit.config import PipelineSchedule
from toolkit.pipeline import stages as runtime
from toolkit.pipeline.batches import pipeline_width
from toolkit.plan import comm, memory
from toolkit.plan.footprint import MemoryEstimate
from toolkit.plan.memory import Precision
from toolkit.plan.parallel import Layout, Mesh
from toolkit.plan.request import PlanRequest

SCHEDULES = get_args(PipelineSchedule)
INTERLEAVED_CHUNKS = 2
"""Model chunks each GPU holds in the interleaved rows: the fewest interleaved_1f1b takes."""
RIDERS = 3 * 8
"""Bytes a token adds to the hidden states a stage sends on: its position id, attention mask and label
(int64 each), which travel forward with them."""


@dataclass(frozen=True)
class Pipe:
    """One pipeline under one schedule: its mesh, how its layers are split, and a step's micro-batches."""

    mesh: Mesh
    schedule: str
    """gpipe | 1f1b | interleaved_1f1b."""
    chunks: int
    """Model chunks (stages) each GPU holds: v."""
    micro_batches: int
    """m: the micro-batches of one copy of the pipeline in one optimizer step."""
    split: tuple[int, ...] = ()
    """Decoder layers of each chunk, first to last (pipeline.layers)."""

    @property
    def bubble(self) -> Fraction:
        """Each GPU idles P - 1 slots while the pipeline fills and drains, against m slots of work (v m slots
        of 1/v the work when it holds v chunks)."""
        gpus = self.mesh.pp
        return Fraction(gpus - 1, self.chunks * self.micro_batches + gpus - 1)

    def in_flight(self, index: int) -> Fraction:
        """Micro-batches whose activations GPU `index` holds at its peak (the module docstring's k)."""
        gpus, most = self.mesh.pp, Fraction(self.micro_batches)
        if self.schedule == "gpipe":
            return most
        held = Fraction(gpus - index)
        if self.schedule == "interleaved_1f1b":
            held *= 1 + Fraction(gpus - 1, gpus * self.chunks)
        return min(most, held)

    def layer_ids(self, index: int) -> list[int]:
        """The decoder layers GPU `index` holds: those of chunks index, index + P, ..."""
        bounds = [0, *itertools.accumulate(self.split)]
        chunks = range(index, len(self.split), self.mesh.pp)
        return [layer for c in chunks for layer in range(bounds[c], bounds[c + 1])]


@dataclass(frozen=True)
class PipelineLayout(Layout):
    """A pipeline mesh under one schedule: the worst GPU's rows, or why it has none."""

    pipe: Pipe | None = None
    """None when the mesh is refused whatever the schedule."""
    gpu_totals: tuple[tuple[int, ...], ...] = ()
    """Per row, the bytes on each GPU of the pipeline, GPU 0 (the first stage) first."""

    @property
    def label(self) -> str:
        return self.mesh.label + (f" {self.pipe.schedule}" if self.pipe else "")


def meshes(gpus: int) -> list[Mesh]:
    """pp across all `gpus`, then pp P x ddp D for every other P >= 2 that divides them, largest P first."""
    if gpus < 2:
        return []
    copies = [Mesh("pp_ddp", pp=p, replicate=gpus // p) for p in range(gpus // 2, 1, -1) if gpus % p == 0]
    return [Mesh("pp", pp=gpus), *copies]


def layouts(
    config, counts, request: PlanRequest, precision: Precision, ckpt_options, micro: int
) -> tuple[PipelineLayout, ...]:
    """Every pipeline layout for `request.gpus` GPUs at micro-batch `micro`: each schedule, one row per
    checkpointing option. `config` is the model's transformers config, as the runtime checks it."""
    found = []
    for mesh in meshes(request.gpus):
        why = refusal(config, mesh, request)
        if why:
            found.append(PipelineLayout(mesh, why))
            continue
        micro_batches = request.global_batch // (micro * mesh.replicate)
        for schedule in SCHEDULES:
            chunks = INTERLEAVED_CHUNKS if schedule == "interleaved_1f1b" else 1
            pipe = Pipe(mesh, schedule, chunks, micro_batches)
            found.append(_layout(counts, pipe, request, precision, ckpt_options, micro))
    return tuple(found)


def refusal(config, mesh: Mesh, request: PlanRequest) -> str | None:
    """Why no schedule runs this model on `mesh`, in one line, as the launch checks say it; None when one
    can."""
    if request.objective == "grpo":
        return "GRPO does not run on a pipeline yet (pipeline.size): use tp, fsdp or zero3 for it"
    if request.method == "qlora":
        return "a pipeline refuses QLoRA (model.method qlora): use ddp, fsdp or zero3 for it"
    if request.reference_model:
        return "a pipeline refuses a separate reference model (dpo.reference_model): use ddp, fsdp or zero3"
    return runtime.model_problem(config, mesh.pp)


def _layout(counts, pipe: Pipe, request: PlanRequest, precision, ckpt_options, micro: int) -> PipelineLayout:
    # m is a multiple of P here (the global batch divides by micro x GPUs), which every torch schedule takes;
    # only the chunks can outnumber the layers.
    chunks = pipe.mesh.pp * pipe.chunks
    if chunks > counts.layers:
        why = f"{pipe.chunks} chunks on each of {pipe.mesh.pp} GPUs need {chunks} decoder layers"
        return PipelineLayout(pipe.mesh, why, pipe=pipe)
    parts = counts.pipeline_parts
    layers = [numel for numel, _ in parts[1:-1]]
    split = runtime.balanced(layers, parts[0][0], parts[-1][0], chunks)
    pipe = dataclasses.replace(pipe, split=tuple(split))
    gpus = range(pipe.mesh.pp)
    per_row = [
        [estimate(counts, pipe, i, request, precision, ckpt, micro) for i in gpus] for ckpt in ckpt_options
    ]
    rows = tuple(max(row, key=lambda gpu: gpu.per_gpu()["total"]) for row in per_row)
    totals = tuple(tuple(gpu.per_gpu()["total"] for gpu in row) for row in per_row)
    sent = comm_bytes(counts, pipe, request, precision, micro)
    return PipelineLayout(
        pipe.mesh, None, rows, (sent,) * len(rows), pipe.micro_batches, pipe=pipe, gpu_totals=totals
    )


def gpu_counts(counts, pipe: Pipe, index: int):
    """The counts of what GPU `index` holds: its chunks' decoder layers, the embeddings on the first GPU,
    the final norm and the head on the last. Quantizable and matmul weights outside the head are shared out
    by the layers' parameters (exact for layers of one size)."""
    parts, ids = counts.pipeline_parts, pipe.layer_ids(index)
    first, last = index == 0, index == pipe.mesh.pp - 1
    held = [parts[1 + i] for i in ids] + ([parts[0]] if first else []) + ([parts[-1]] if last else [])
    total, trainable = sum(n for n, _ in held), sum(t for _, t in held)
    mine, every = sum(parts[1 + i][0] for i in ids), sum(n for n, _ in parts[1:-1])

    def share(numel: int) -> int:
        return numel * mine // every

    frozen_head, trained_head = (0, counts.lm_head) if counts.method == "full" else (counts.lm_head, 0)
    return dataclasses.replace(
        counts,
        total=total,
        frozen=total - trainable,
        trainable=trainable,
        quantizable=share(counts.quantizable),
        matmul_frozen=share(counts.matmul_frozen - frozen_head) + (frozen_head if last else 0),
        matmul_trainable=share(counts.matmul_trainable - trained_head) + (trained_head if last else 0),
        embed=counts.embed if first else 0,
        lm_head=counts.lm_head if last else 0,
        layers=len(ids),
        mixers=tuple(counts.mixers[i] for i in ids) if counts.mixers else (),
    )


def estimate(
    counts, pipe: Pipe, index: int, request: PlanRequest, precision: Precision, ckpt: bool, micro: int
) -> MemoryEstimate:
    """GPU `index` of `pipe`: its stages' model states as one process holds them (no DDP wrapper), the
    activations of its micro-batches in flight, and the loss head on the last GPU."""
    held = gpu_counts(counts, pipe, index)
    states = memory.model_state_bytes(held, "single", 1, precision)
    working = memory.working_weight_bytes(held, "single", precision)
    tokens = _tokens(request, micro)
    last = index == pipe.mesh.pp - 1
    loss_head = _head_bytes(held, pipe, tokens, request, precision) if last else 0
    activations = loss_head + _layer_activations(held, pipe, index, tokens, ckpt, precision, request)
    if pipe.mesh.replicate > 1:
        states = dataclasses.replace(states, grad_buckets=max(0, states.grads - working - activations))
    tensors = states.total + working + activations
    return MemoryEstimate(
        backend=pipe.mesh.backend,
        checkpointing=ckpt,
        micro_batch=micro,
        states=states,
        working=working,
        activations=activations,
        head=loss_head,
        overhead=memory.overhead_bytes(tensors, "ddp", pipe.mesh.gpus, held, precision),
        cpu_ram=memory.cpu_ram_bytes(counts, "ddp", pipe.mesh.gpus, states, precision),
    )


def _tokens(request: PlanRequest, micro: int) -> int:
    """Tokens of one micro-batch as the runtime shapes it: micro rows (two per pair under DPO) of seq rounded
    up to 8."""
    return micro * request.rows_per_example * pipeline_width(request.seq_len)


def _head_bytes(held, pipe: Pipe, tokens: int, request: PlanRequest, precision: Precision) -> int:
    head = request.head
    waiting = pipe.micro_batches - 1 if pipe.schedule == "gpipe" else 0
    kept = memory.head_kept_bytes(held, tokens, "single", precision, head)
    return memory.head_bytes(held, tokens, "single", precision, head) + waiting * kept


def _layer_activations(held, pipe: Pipe, index: int, tokens: int, ckpt: bool, precision, request) -> int:
    layer, kept, norm = memory.token_activation_bytes(held, precision, request.lora_dropout)
    last = index == pipe.mesh.pp - 1
    stack = (
        held.layers * kept if ckpt else memory.stack_activation_bytes(held, precision, request.lora_dropout)
    )
    per_micro_batch = stack + (norm if last else 0)
    recomputed = layer * tokens if ckpt else 0
    return math.ceil(pipe.in_flight(index) * per_micro_batch * tokens) + recomputed


def comm_bytes(counts, pipe: Pipe, request: PlanRequest, precision: Precision, micro: int) -> int:
    """Bytes the busiest GPU of `pipe` sends per optimizer step: the hidden states forward (with their
    riders) and their gradient back at every boundary it has, and under pp x ddp the all-reduce of its
    stage's gradients across the copies."""
    tokens = _tokens(request, micro)
    gradient = tokens * counts.hidden * memory.residual_bytes(counts, precision)
    forward = gradient + tokens * RIDERS
    grad_b = memory.param_bytes(counts.method, "ddp", precision)[1]
    copies = pipe.mesh.replicate

    def sent(index: int) -> int:
        p2p = comm.pipeline_bytes(pipe.mesh.pp, pipe.chunks, index, pipe.micro_batches, forward, gradient)
        if copies == 1:
            return p2p
        return p2p + comm.all_reduce(copies, gpu_counts(counts, pipe, index).trainable * grad_b)

    return max(sent(index) for index in range(pipe.mesh.pp))
