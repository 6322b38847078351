"""`ftkit plan`: what a fine-tune needs per GPU under each backend, which one to launch, and what it costs,
from the model's config alone (know before you rent)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from toolkit.errors import UserError
from toolkit.launch.machine import GIB
from toolkit.model import flops
from toolkit.plan import (
    comm,
    embedding,
    engine,
    generation,
    images,
    longest,
    memory,
    parallel,
    pipeline,
    sequence,
)
from toolkit.plan.cost import Cost, CostRequest, estimate_cost
from toolkit.plan.counts import ModelCounts, count_parameters, load_model_config
from toolkit.plan.footprint import NO_IMAGES, ImageBytes, MemoryEstimate
from toolkit.plan.images import ImageRows
from toolkit.plan.launch_line import launch_line
from toolkit.plan.memory import Precision
from toolkit.plan.request import PlanRequest

# Fastest first. Gradient checkpointing costs about a third more compute; ZeRO-1/2 move no more data than
# DDP, while ZeRO-3/FSDP gather every weight twice a step and offload crosses PCIe every step.
MULTI_GPU_TIERS = (("ddp", "zero1", "zero2"), ("fsdp", "zero3"), ("zero3_offload",))
SINGLE_GPU_TIERS = (("single",), ("zero3_offload",))


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    counts: ModelCounts
    precision: Precision
    rows: list[MemoryEstimate]
    choice: MemoryEstimate | None
    """The recommended setup, None when nothing fits."""
    command: str | None
    flops_per_token: int
    cost: Cost | None
    full_head: MemoryEstimate | None = None
    """The recommended setup with the full logits instead of the chunked head (None under loss.head full)."""
    layouts: tuple[parallel.Layout, ...] = ()
    """The model-parallel layouts (tp, fsdp_tp, hsdp, ep, then the pipelines pp and pp_ddp, then sequence
    parallelism under ZeRO) on more than one GPU, at the rows' micro-batch."""
    comm: dict[str, int] = dataclasses.field(default_factory=dict)
    """Bytes each GPU sends per optimizer step under each data-parallel backend, at the rows' micro-batch."""
    longest: dict[str, int] | None = None
    """With --longest-seq: each backend's and layout's longest --seq-len that fits (`plan.longest`; 0: not
    even the shortest), at the rows' micro-batch; None without."""
    images: ImageRows | None = None
    """A vision-language model's images per row (None: a text model)."""
    engine: engine.EngineBytes | None = None
    """grpo.generation vllm: the engine on its GPU (`plan.engine`); None otherwise."""

    def fits(self, row: MemoryEstimate) -> bool:
        """The setup fits its GPUs, and the engine (if any) starts on its share of its GPU."""
        return fits(row, self.request) and (self.engine is None or self.engine.starts)

    def grad_accum(self, row: MemoryEstimate) -> int:
        return grad_accum(self.request, row.backend, row.micro_batch)


def requests_from_options(options: dict) -> tuple[PlanRequest, CostRequest | None]:
    """Requests from parsed command-line options; options left out take the dataclass defaults."""
    names = {f.name for f in dataclasses.fields(PlanRequest)}
    request = PlanRequest(**{k: v for k, v in options.items() if k in names and v is not None})
    cost_options = ("tokens_per_s", "from_run", "price_per_gpu_hour")
    if options.get("tokens") is None:
        given = [k for k in cost_options if options.get(k) is not None]
        if given:
            raise UserError(f"--{given[0].replace('_', '-')} needs --tokens N (how many tokens to train on)")
        return request, None
    return request, CostRequest(int(options["tokens"]), *(options.get(k) for k in cost_options))


def make_plan(request: PlanRequest, cost: CostRequest | None = None) -> Plan:
    """Count the model, estimate every backend, and pick the fastest setup that fits."""
    request.validate()
    config, source = load_model_config(request.model)
    scores = request.head_width if request.objective == "embed" else None
    counts = count_parameters(config, request.method, request.lora_r, source, request.vision, scores)
    request.check_model(counts.model_type, counts.vision is not None)
    if request.packing and counts.packing_leak:
        raise UserError(
            f"--packing: {request.model} ({counts.model_type}) has {counts.packing_leak} layers, which let "
            "one packed example reach the next; the recipe refuses data.packing on it"
        )
    rows_of_images = _image_rows(counts, request)
    if rows_of_images is not None:
        images.check_row(rows_of_images, request.row_tokens)
    precision = resolve_precision(request)
    micro = request.micro_batch or 1
    rows = [
        _estimate(counts, request, precision, b, ckpt, micro)
        for b in _backends(request)
        for ckpt in _ckpt_options(request)
    ]
    sampler = engine.estimate(counts, request, precision)
    choice = recommend(counts, request, precision) if sampler is None or sampler.starts else None
    return Plan(
        request=request,
        counts=counts,
        precision=precision,
        rows=rows,
        choice=choice,
        command=launch_line(choice, request, precision, counts.vision is not None) if choice else None,
        flops_per_token=flops.flops_per_token(counts, request.row_tokens),
        cost=estimate_cost(cost, request.gpus) if cost else None,
        full_head=_with_full_head(choice, counts, request, precision),
        layouts=_layouts(config, counts, request, precision, micro),
        comm=_data_parallel_comm(counts, request, precision, micro),
        longest=longest.longest_fitting(_fitting(config, counts, request, precision, micro))
        if request.longest_seq
        else None,
        images=rows_of_images,
        engine=sampler,
    )


def _image_rows(counts: ModelCounts, request: PlanRequest) -> ImageRows | None:
    """The images each row holds (None for a text model)."""
    if counts.vision is None:
        return None
    return images.image_rows(
        counts.vision, counts.model_type, request.images_per_row, request.max_pixels, request.row_tokens
    )


def _backends(request: PlanRequest) -> tuple[str, ...]:
    """The data-parallel backends with rows: every one on several GPUs, those of the tiers on one."""
    return tuple(b for tier in SINGLE_GPU_TIERS for b in tier) if request.gpus == 1 else memory.BACKENDS


def _layouts(config, counts, request: PlanRequest, precision, micro: int) -> tuple[parallel.Layout, ...]:
    """The layouts beside the data-parallel backends, in the order the report shows them."""
    if counts.vision is not None:
        why = f"does not train a vision-language model ({counts.model_type}) yet"
        return _refusals(counts, request.gpus, f"{why}; use ddp, fsdp or zero1/2/3")
    if request.objective == "embed":
        return _refusals(
            counts, request.gpus, "is refused by the embedding recipe; use ddp, fsdp or zero1/2/3"
        )
    ckpt = _ckpt_options(request)
    return (
        parallel.layouts(counts, request, precision, ckpt, micro)
        + pipeline.layouts(config, counts, request, precision, ckpt, micro)
        + sequence.layouts(counts, request, precision, ckpt, micro)
    )


def _refusals(counts, gpus: int, why: str) -> tuple[parallel.Layout, ...]:
    """Every model-parallel layout, refused as the launch checks refuse it (a vision-language model, an
    embedding run)."""
    meshes = parallel.meshes(gpus, counts.experts) + pipeline.meshes(gpus) + sequence.meshes(gpus)
    return tuple(parallel.Layout(mesh, f"{mesh.label} {why}") for mesh in meshes)


def _fitting(config, counts, request: PlanRequest, precision, micro: int):
    """What `longest.longest_fitting` asks: at a sequence length, whether some checkpointing option of each
    backend and of each layout with rows fits."""

    def fits_at(seq_len: int) -> dict[str, bool]:
        at = dataclasses.replace(request, seq_len=seq_len)
        options = _ckpt_options(at)
        found = {
            backend: any(fits(_estimate(counts, at, precision, backend, c, micro), at) for c in options)
            for backend in _backends(at)
        }
        for layout in _layouts(config, counts, at, precision, micro):
            if layout.rows:
                found[layout.label] = any(fits(row, at) for row in layout.rows)
        return found

    return fits_at


def _data_parallel_comm(counts, request: PlanRequest, precision, micro: int) -> dict[str, int]:
    if request.gpus == 1:
        return {}
    micro_batches = request.global_batch // (micro * request.gpus)
    return {
        backend: comm.data_parallel_bytes(counts, backend, request.gpus, micro_batches, precision)
        for backend in memory.BACKENDS
        if backend != "single"
    }


def _with_full_head(
    row: MemoryEstimate | None, counts, request: PlanRequest, precision
) -> MemoryEstimate | None:
    """`row` as it would be with the full logits, to tell what fits only thanks to the chunked head."""
    if row is None or request.head is None or memory.full_logits(counts, request.head):
        return None
    full = dataclasses.replace(request, loss_head="full")
    return _estimate(counts, full, precision, row.backend, row.checkpointing, row.micro_batch)


def resolve_precision(request: PlanRequest) -> Precision:
    """The weights dtype and autocast the recipe would use (the shipped recipe configs' choice for auto)."""
    weights = request.dtype
    if weights == "auto":
        weights = "float32" if request.method == "full" else "bfloat16"
    return Precision(weights=weights, mixed=request.mixed_precision)


def tiers(gpus: int) -> tuple[tuple[str, ...], ...]:
    return SINGLE_GPU_TIERS if gpus == 1 else MULTI_GPU_TIERS


def processes(backend: str, gpus: int) -> int:
    return 1 if backend == "single" else gpus


def grad_accum(request: PlanRequest, backend: str, micro: int) -> int:
    """Micro-batches each process runs per optimizer step."""
    return request.global_batch // (micro * processes(backend, request.gpus))


def fits(row: MemoryEstimate, request: PlanRequest, margin: float | None = None) -> bool:
    """Whether the setup fits each GPU with `margin` (default: the request's) of its memory left free, and
    the machine's CPU RAM where that was given."""
    margin = request.margin if margin is None else margin
    in_gpu = row.per_gpu()["total"] <= request.gpu_mem * (1 - margin) * GIB
    return in_gpu and (request.cpu_mem is None or row.cpu_ram <= request.cpu_mem * GIB)


def recommend(counts: ModelCounts, request: PlanRequest, precision: Precision) -> MemoryEstimate | None:
    """The first fitting setup, fastest tier first and checkpointing in `_ckpt_options` order; then the
    micro-batch doubles while it fits and divides the per-GPU batch (unless --micro-batch fixed it)."""
    for tier in tiers(request.gpus):
        for ckpt in _ckpt_options(request):
            for backend in tier:
                row = _estimate(counts, request, precision, backend, ckpt, request.micro_batch or 1)
                if fits(row, request):
                    return row if request.micro_batch else _grow_micro_batch(row, counts, request, precision)
    return None


def _grow_micro_batch(row: MemoryEstimate, counts, request: PlanRequest, precision) -> MemoryEstimate:
    per_gpu_batch = request.global_batch // processes(row.backend, request.gpus)
    while per_gpu_batch % (row.micro_batch * 2) == 0:
        bigger = _estimate(counts, request, precision, row.backend, row.checkpointing, row.micro_batch * 2)
        if not fits(bigger, request):
            break
        row = bigger
    return row


def _estimate(
    counts, request: PlanRequest, precision, backend: str, ckpt: bool, micro: int
) -> MemoryEstimate:
    reference = reference_bytes(counts, request, precision, backend)
    pair_loss = (
        embedding.loss_bytes(counts, request, precision, processes(backend, request.gpus), micro)
        if request.objective == "embed"
        else 0
    )
    row = memory.estimate(
        counts,
        backend,
        request.gpus,
        request.row_tokens,
        micro,
        ckpt,
        precision,
        request.lora_dropout,
        sequences_per_example=request.rows_per_example,
        reference=reference,
        head=request.head,
        offload=request.activation_offload,
        accumulation=grad_accum(request, backend, micro),
        images=_image_bytes(counts, request, precision, ckpt, micro),
        pair_loss=pair_loss,
    )
    on_gpu = engine.training_gpu_bytes(counts, request, precision)
    if on_gpu:
        row = dataclasses.replace(row, engine=on_gpu)
    plan_round = request.generation_round()
    if plan_round is None:
        return row
    data_parallel = processes(backend, request.gpus)
    phase = generation.estimate(
        counts, backend, request.gpus, row.states, precision, plan_round, reference, data_parallel
    )
    return dataclasses.replace(row, generation=phase)


def _image_bytes(counts, request: PlanRequest, precision, ckpt: bool, micro: int) -> ImageBytes:
    if counts.vision is None:
        return NO_IMAGES
    return images.micro_batch_bytes(
        counts.vision,
        _image_rows(counts, request),
        micro * request.rows_per_example,
        counts.method,
        precision,
        ckpt,
        request.lora_dropout,
    )


def reference_bytes(counts, request: PlanRequest, precision: Precision, backend: str) -> int:
    """A separate reference model's weights per GPU: the model whole, sharded like the policy under
    FSDP/ZeRO-3."""
    if not request.reference_model:
        return 0
    whole = counts.total * (4 if precision.weights == "float32" else 2)
    return whole // request.gpus if backend in ("fsdp", "zero3", "zero3_offload") else whole


def _ckpt_options(request: PlanRequest) -> tuple[bool, ...]:
    """Checkpointing off before on; with activation offload on before off (it moves only the layers'
    inputs through CPU RAM, not every activation)."""
    auto = (True, False) if request.activation_offload else (False, True)
    return {"auto": auto, "on": (True,), "off": (False,)}[request.grad_ckpt]
