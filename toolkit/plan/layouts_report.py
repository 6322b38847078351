"""The model-parallel part of `ftkit plan`'s text: each layout's memory and traffic per GPU (sequence
parallelism's all-to-alls noted on its rows), what cannot be split and why, each pipeline's split, and what
tensor parallelism and pipelines send against data parallelism."""

from __future__ import annotations

from toolkit.launch.machine import GIB
from toolkit.plan.estimate import Plan
from toolkit.plan.parallel import Layout
from toolkit.plan.pipeline import INTERLEAVED_CHUNKS, PipelineLayout
from toolkit.plan.tables import heading, row_line


def layouts_section(plan: Plan) -> list[str]:
    """The model-parallel layouts: memory and traffic per GPU, what cannot be split, and the trade-off."""
    if not plan.layouts:
        return []
    micro = plan.rows[0].micro_batch
    piped = bool(_pipelines(plan))
    head = heading(plan, "model parallel, micro-batch " + str(micro))
    head += f"{'CPU RAM':>9}{'comm/step':>11}" + (f"{'schedule':>12}{'bubble':>7}" if piped else "")
    lines = ["", head + f"  fits {plan.request.gpu_mem:g} GiB"]
    for layout in plan.layouts:
        a2a = layout.all_to_all or (None,) * len(layout.rows)
        for row, sent, part in zip(layout.rows, layout.comm, a2a):
            cells = f"{_size(sent):>11}" + (_schedule_cells(layout) if piped else "")
            note = f"all-to-all {_size(part)}/step" if part is not None else ""
            lines.append(row_line(plan, row, layout.mesh.label, cells, note))
    lines += _refusals(plan)
    split = [layout for layout in plan.layouts if layout.mesh.pp == layout.mesh.ep == layout.mesh.sp == 1]
    if any(layout.mesh.ep > 1 for layout in plan.layouts):
        lines.append(
            "  ep E: the routed experts split E ways and each token sent to its experts' GPU (all-to-all); "
            "the rest whole, each GPU its own micro-batch (accelerate_configs/ep.yaml)"
        )
    if split:
        lines.append(
            "  tp T: T GPUs split each layer and share each micro-batch; fsdp_tp DxT: FSDP over D, tp T; "
            "hsdp RxS: R copies of an S-way FSDP"
            + ("" if len(split) > 1 else " (fsdp_tp and hsdp need an even number of GPUs, 4 or more)")
        )
    lines += _pipeline_legend(plan)
    lines += _sequence_legend(plan)
    dp = " | ".join(f"{backend} {_size(sent)}" for backend, sent in plan.comm.items())
    lines.append(f"comm     per GPU per optimizer step at micro-batch {micro} (toolkit/plan/comm.py): {dp}")
    return lines + _pcie_note(plan)


def _sequence_legend(plan: Plan) -> list[str]:
    """What the sequence-parallel rows mean, and which config file runs each."""
    meshes = [layout.mesh for layout in plan.layouts if layout.mesh.sp > 1 and layout.rows]
    if not meshes:
        return []
    files = ", ".join(f"{mesh.label} accelerate_configs/{mesh.backend}.yaml" for mesh in meshes)
    return [
        "  zero + sp N: N GPUs share each micro-batch, each holding seq/N tokens of every sequence "
        "(DeepSpeed Ulysses: an all-to-all around attention), states sharded by the ZeRO stage over all "
        f"GPUs; x dp D: D such groups, each its own micro-batch ({files}; toolkit/plan/sequence.py)"
    ]


def _pipelines(plan: Plan) -> list[PipelineLayout]:
    """The pipeline layouts that have rows."""
    return [layout for layout in plan.layouts if isinstance(layout, PipelineLayout) and layout.rows]


def _headline(layouts: list[PipelineLayout]) -> PipelineLayout:
    """The one a line speaks for: under 1f1b, the runtime's default schedule, when it has rows."""
    return next((layout for layout in layouts if layout.pipe.schedule == "1f1b"), layouts[0])


def _schedule_cells(layout: Layout) -> str:
    if not isinstance(layout, PipelineLayout):
        return " " * 19
    name = layout.pipe.schedule.removesuffix("_1f1b")
    return f"{name:>12}{_percent(layout.pipe.bubble):>7}"


def _pipeline_legend(plan: Plan) -> list[str]:
    """What pp means, and each pipeline's split with the total of each of its GPUs."""
    if not _pipelines(plan):
        return []
    lines = [
        "  pp P: P GPUs each hold one stage of consecutive layers (the first also the embeddings, the last "
        "the norm, head and loss) and pass each micro-batch on; pp P x ddp D: D copies of it",
        "  pipelines show their worst GPU; bubble: each GPU's idle share of a step; interleaved: "
        f"interleaved_1f1b with {INTERLEAVED_CHUNKS} chunks a GPU (toolkit/plan/pipeline.py)",
    ]
    by_mesh: dict = {}
    for layout in _pipelines(plan):
        by_mesh.setdefault(layout.mesh, []).append(layout)
    for mesh, found in by_mesh.items():
        shown = _headline(found)
        pipe, ckpt = shown.pipe, "on" if shown.rows[0].checkpointing else "off"
        totals = " | ".join(f"{total / GIB:.1f}" for total in shown.gpu_totals[0])
        chunks = "".join(
            f", {lay.pipe.schedule} {_split(lay.pipe.split)}" for lay in found if lay.pipe.chunks > 1
        )
        lines.append(
            f"  {mesh.label}: layers {_split(pipe.split)}{chunks}; {pipe.micro_batches} micro-batches a "
            f"step; GiB by GPU under {pipe.schedule}, grad ckpt {ckpt}: {totals}"
        )
    return lines


def _split(layers: tuple[int, ...]) -> str:
    return " | ".join(map(str, layers))


def _percent(share) -> str:
    value = 100 * float(share)
    return f"{value:.1f}%" if value >= 0.1 else f"{value:.2f}%"


def _refusals(plan: Plan) -> list[str]:
    """One line per reason, naming every layout it stops."""
    reasons: dict[str, list[str]] = {}
    for layout in plan.layouts:
        if layout.refusal:
            reasons.setdefault(layout.refusal, []).append(layout.label)
    return [f"{', '.join(labels):33}no numbers: {reason}" for reason, labels in reasons.items()]


def _pcie_note(plan: Plan) -> list[str]:
    """Tensor parallelism's and the pipeline's traffic against data parallelism's, and when each is worth it
    without NVLink."""
    tp = _tp_note(plan)
    return tp + _pipeline_note(plan, "  " if tp else "PCIe     ")


def _pipeline_note(plan: Plan, prefix: str) -> list[str]:
    """The pipeline's traffic against FSDP's and ZeRO-3's, and what it pays instead."""
    piped = _pipelines(plan)
    if not piped:
        return []
    layout = _headline(piped)
    sent, fsdp, zero3 = layout.comm[0], plan.comm["fsdp"], plan.comm["zero3"]
    return [
        f"{prefix}A pipeline sends only activations between neighbouring stages: {layout.label} "
        f"{_size(sent)} per GPU per step, {_ratio(sent, fsdp)} fsdp's {_size(fsdp)} and "
        f"{_ratio(sent, zero3)} zero3's {_size(zero3)}; it pays with its bubble instead "
        f"({_percent(layout.pipe.bubble)} of each GPU idle: more micro-batches a step shrink it)."
    ]


def _tp_note(plan: Plan) -> list[str]:
    """Tensor parallelism's traffic against data parallelism's, and when it is worth it without NVLink."""
    split = [layout for layout in plan.layouts if layout.mesh.tp > 1 and layout.rows]
    if not split:
        return []
    layout, sent = split[0], split[0].comm[0]
    ddp, fsdp = plan.comm["ddp"], plan.comm["fsdp"]
    lines = [
        f"PCIe     {layout.mesh.label} sends {_size(sent)} per GPU per step, {_ratio(sent, ddp)} ddp's "
        f"{_size(ddp)} and {_ratio(sent, fsdp)} fsdp's {_size(fsdp)}: its activations cross the link at "
        "every layer of every micro-batch."
    ]
    choice, gpus = plan.choice, plan.request.gpus
    on_gpu = choice is not None and not choice.states.in_cpu_ram
    fitting = [lay.mesh.label for lay in plan.layouts if lay.mesh.tp > 1 and any(map(plan.fits, lay.rows))]
    if on_gpu:
        lines.append(
            f"  Without NVLink (e.g. {gpus}x RTX 4090) prefer {choice.backend}, which fits; "
            "tensor parallelism pays off there only when the weights fit no data-parallel layout."
        )
    elif fitting:
        lines.append(
            f"  No data-parallel layout fits without offload but {' and '.join(fitting)} does: without "
            "NVLink keep sequences short and batches small, as its traffic grows with seq x global batch."
        )
    return lines


def _size(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            value = n / scale
            return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{n} B"


def _ratio(a: int, b: int) -> str:
    if b == 0:
        return "n/a x"
    ratio = a / b
    return f"{ratio:,.0f}x" if ratio >= 10 else f"{ratio:.2g}x"
