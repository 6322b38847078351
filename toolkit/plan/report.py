"""How `ftkit plan` shows a plan: a table for people, a JSON document for machines."""

from __future__ import annotations

import dataclasses

from toolkit.launch.machine import GIB
from toolkit.plan.estimate import Plan
from toolkit.plan.memory import MemoryEstimate, qlora_load_bytes
from toolkit.plan.parallel import Layout
from toolkit.plan.pipeline import INTERLEAVED_CHUNKS, PipelineLayout

COLUMNS = ("weights", "lora", "grads", "optimizer", "activations", "overhead", "total")
HEADINGS = ("weights", "lora", "grads", "optim", "activ", "other", "total")
GENERATION_COLUMNS = ("resident", "gathered", "kv_cache", "logits", "prefill", "overhead")
GENERATION_HEADINGS = ("states", "gathered", "kv cache", "logits", "prefill", "other", "total")
PHASES = {"training": "train", "generation": "gen"}


def render_text(plan: Plan) -> str:
    """The plan as the terminal shows it: model, setup, per-GPU memory by backend, recommendation, cost."""
    lines = [*_header(plan), "", *_table(plan), *_generation(plan), "", *_recommendation(plan)]
    lines += _head_note(plan)
    lines += _qlora_loading(plan)
    lines += _layouts(plan)
    if plan.cost is not None:
        lines += ["", *_cost(plan)]
    lines += [
        "",
        "Model states (weights, lora, grads, optim) are exact bytes; activations and other (CUDA context, "
        "NCCL, fragmentation) are estimates: see toolkit/plan/memory.py.",
    ]
    return "\n".join(lines)


def _header(plan: Plan) -> list[str]:
    c, r, p = plan.counts, plan.request, plan.precision
    trained = "all weights" if c.method == "full" else f"LoRA r={c.lora_r} on all linear layers"
    autocast = "bf16 autocast" if p.mixed == "bf16" else "no autocast"
    base = "4-bit NF4 base" if c.method == "qlora" else f"weights {p.weights}"
    head = f"chunked loss head ({r.chunk_tokens} tokens)" if r.loss_head == "chunked" else "full logits"
    return [
        f"model    {r.model} ({c.source}): {c.model_type}, {c.layers} layers, hidden {c.hidden}, "
        f"{c.heads} heads ({c.kv_heads} kv), vocab {c.vocab:,}",
        f"params   {c.total:,} total, {c.trainable:,} trainable "
        f"({100 * c.trainable / c.total:.2f}%: {trained})",
        f"setup    {c.method} on {r.gpus} GPU x {r.gpu_mem:g} GiB | {base}, {autocast} | "
        f"seq {r.seq_len} | global batch {r.global_batch} | {head}",
        f"compute  {plan.flops_per_token / 1e9:.2f} GFLOP per trained token (see toolkit/model/flops.py)",
        *_grpo_setup(plan),
    ]


def _grpo_setup(plan: Plan) -> list[str]:
    """The round a GRPO plan assumes, and where its reference comes from."""
    r = plan.request
    plan_round = r.generation_round()
    if plan_round is None:
        return []
    if r.beta == 0:
        reference = "beta 0: no reference"
    elif r.reference_model:
        reference = f"beta {r.beta:g}: a separate reference model"
    else:
        reference = f"beta {r.beta:g}: reference = the policy with its adapter off (no extra memory)"
    batch = f"{r.generation_batch} at once" if r.generation_batch else "its whole share at once"
    return [
        f"grpo     {r.generations} completions a prompt, {plan_round.completions} a round (global batch "
        f"{r.global_batch} x {r.steps_per_generation} steps), each GPU generating {batch}; "
        f"prompt {r.seq_len} + {r.max_new_tokens} new tokens a row; gather for generation "
        f"{'on' if r.gather_for_generation else 'off'}; {reference}"
    ]


def _table(plan: Plan) -> list[str]:
    limit = f"fits {plan.request.gpu_mem:g} GiB"
    micro = plan.rows[0].micro_batch
    head = f"{'per GPU (GiB), micro-batch ' + str(micro):33}" + "".join(f"{h:>7}" for h in HEADINGS)
    head += f"{'peak':>6}" if _generates(plan) else ""
    return [head + f"{'CPU RAM':>9}  {limit}", *(_row(plan, row, row.backend) for row in plan.rows)]


def _generates(plan: Plan) -> bool:
    return plan.request.generation_round() is not None


def _row(plan: Plan, row: MemoryEstimate, name: str, extra: str = "") -> str:
    parts = row.per_gpu()
    name = f"{name:14}grad ckpt {'on ' if row.checkpointing else 'off'}"
    cells = "".join(f"{parts[k] / GIB:7.1f}" for k in COLUMNS)
    cells += f"{PHASES[row.peak_phase]:>6}" if _generates(plan) else ""
    note = "  (states in CPU RAM)" if row.states.in_cpu_ram else ""
    return f"{name:33}{cells}{row.cpu_ram / GIB:9.1f}{extra}  {'yes' if plan.fits(row) else 'no'}{note}"


def _generation(plan: Plan) -> list[str]:
    """GRPO's generation phase on each setup: what stays from training and what generating adds."""
    if not _generates(plan):
        return []
    shown: dict[str, MemoryEstimate] = {}
    for row in plan.rows:
        shown.setdefault(row.backend, row)
    for layout in plan.layouts:
        if layout.rows:
            shown.setdefault(layout.label, layout.rows[0])
    headings = "".join(f"{h:>9}" for h in GENERATION_HEADINGS)
    lines = ["", f"{'generation phase per GPU (GiB)':33}{'rows':>5}{headings}"]
    for name, row in shown.items():
        phase = row.generation
        cells = "".join(f"{getattr(phase, k) / GIB:9.1f}" for k in GENERATION_COLUMNS)
        lines.append(f"{name:33}{phase.rows:>5}{cells}{phase.total / GIB:9.1f}")
    return lines + [
        "  rows: completions a GPU generates at once; states: what it keeps from training (states after a "
        "step, a separate reference); gathered: the whole model (zero3/fsdp with gather for generation)",
        "  the tables of setups show training's parts and the total of the larger phase (peak: train or "
        "gen); see toolkit/plan/generation.py",
    ]


def _recommendation(plan: Plan) -> list[str]:
    row, r = plan.choice, plan.request
    if row is None:
        smallest = min(plan.rows, key=lambda x: x.per_gpu()["total"])
        return [
            f"nothing fits in {r.gpu_mem:g} GiB per GPU"
            + (f" and {r.cpu_mem:g} GiB CPU RAM" if r.cpu_mem is not None else "")
            + f"; the smallest is {smallest.backend}: {smallest.per_gpu()['total'] / GIB:.1f} GiB per GPU, "
            f"{smallest.cpu_ram / GIB:.1f} GiB CPU RAM{_phases(smallest)}. "
            "Try --method lora or qlora, a shorter --seq-len, or more or larger GPUs"
            + (
                "; a smaller --generation-batch or --max-new-tokens shrinks the generation phase."
                if smallest.peak_phase == "generation"
                else "."
            )
        ]
    procs = 1 if row.backend == "single" else r.gpus
    ckpt = "on" if row.checkpointing else "off"
    lines = [
        f"recommended: accelerate_configs/{row.backend}.yaml, gradient checkpointing {ckpt}, micro-batch "
        f"{row.micro_batch} x GA {plan.grad_accum(row)} x {procs} GPU = global batch {r.global_batch}",
        f"  {row.per_gpu()['total'] / GIB:.1f} of {r.gpu_mem:g} GiB per GPU{_phases(row)}, "
        f"{row.cpu_ram / GIB:.1f} GiB CPU RAM",
    ]
    if plan.command:
        lines.append(f"  {plan.command}")
    return lines


def _phases(row: MemoryEstimate) -> str:
    """Which phase sets a GRPO setup's peak, and the other's total."""
    if row.generation is None:
        return ""
    parts = row.per_gpu()
    other = "training" if row.peak_phase == "generation" else "generation"
    return f", peak in {row.peak_phase} ({other} {parts[other] / GIB:.1f})"


def _head_note(plan: Plan) -> list[str]:
    """One line when the recommended setup fits only because the whole logits never exist."""
    full = plan.full_head
    if full is None or plan.fits(full):
        return []
    total = full.per_gpu()["total"] / GIB
    more = total - plan.choice.per_gpu()["total"] / GIB
    return [
        f"  fits thanks to the chunked loss head: the full logits would need {more:.1f} GiB more per GPU at "
        f"micro-batch {full.micro_batch} ({total:.1f} of {plan.request.gpu_mem:g} GiB)"
    ]


def _qlora_loading(plan: Plan) -> list[str]:
    """The peak the table leaves out: ftkit loads a whole 4-bit base per process before FSDP2 or ZeRO-3
    shard it, so a sharded QLoRA run also needs that much on each GPU (FSDP2) while loading."""
    if plan.counts.method != "qlora":
        return []
    load = qlora_load_bytes(plan.counts) / GIB
    fits = "fits" if load <= plan.request.gpu_mem else "does not fit"
    return [
        f"note: loading, each process first holds the whole 4-bit base ({load:.1f} GiB; {fits} in "
        f"{plan.request.gpu_mem:g} GiB) before fsdp/zero3 shard it; not in the table above"
    ]


def _layouts(plan: Plan) -> list[str]:
    """The model-parallel layouts: memory and traffic per GPU, what cannot be split, and the trade-off."""
    if not plan.layouts:
        return []
    micro = plan.rows[0].micro_batch
    piped = bool(_pipelines(plan))
    head = f"{'model parallel, micro-batch ' + str(micro):33}" + "".join(f"{h:>7}" for h in HEADINGS)
    head += f"{'peak':>6}" if _generates(plan) else ""
    head += f"{'CPU RAM':>9}{'comm/step':>11}" + (f"{'schedule':>12}{'bubble':>7}" if piped else "")
    lines = ["", head + f"  fits {plan.request.gpu_mem:g} GiB"]
    for layout in plan.layouts:
        for row, sent in zip(layout.rows, layout.comm):
            cells = f"{_size(sent):>11}" + (_schedule_cells(layout) if piped else "")
            lines.append(_row(plan, row, layout.mesh.label, cells))
    lines += _refusals(plan)
    split = [layout for layout in plan.layouts if layout.mesh.pp == 1]
    if split:
        lines.append(
            "  tp T: T GPUs split each layer and share each micro-batch; fsdp_tp DxT: FSDP over D, tp T; "
            "hsdp RxS: R copies of an S-way FSDP"
            + ("" if len(split) > 1 else " (fsdp_tp and hsdp need an even number of GPUs, 4 or more)")
        )
    lines += _pipeline_legend(plan)
    dp = " | ".join(f"{backend} {_size(sent)}" for backend, sent in plan.comm.items())
    lines.append(f"comm     per GPU per optimizer step at micro-batch {micro} (toolkit/plan/comm.py): {dp}")
    return lines + _pcie_note(plan)


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


def _cost(plan: Plan) -> list[str]:
    cost = plan.cost
    lines = [
        f"time     {cost.tokens:,} tokens at {cost.tokens_per_s:,.0f} tokens/s ({cost.throughput_source}): "
        f"{cost.wall_hours:.2f} h wall, {cost.gpu_hours:.2f} GPU-hours on {plan.request.gpus} GPU",
        f"compute  {cost.tokens * plan.flops_per_token:.3g} FLOP",
    ]
    if cost.price is not None:
        lines.append(f"cost     {cost.price:,.2f} at {cost.price_per_gpu_hour:g} per GPU-hour")
    return lines


def to_json(plan: Plan) -> dict:
    """Every number of the plan, in bytes, for scripts."""
    choice = plan.choice
    return {
        "model": {"id": plan.request.model, **dataclasses.asdict(plan.counts)},
        "request": dataclasses.asdict(plan.request),
        "precision": dataclasses.asdict(plan.precision),
        "flops_per_token": plan.flops_per_token,
        "backends": [_row_json(plan, row) for row in plan.rows],
        "recommendation": None
        if choice is None
        else {
            **_row_json(plan, choice),
            "grad_accum": plan.grad_accum(choice),
            "config_file": f"accelerate_configs/{choice.backend}.yaml",
            "command": plan.command,
            "full_head_per_gpu_bytes": None if plan.full_head is None else plan.full_head.per_gpu()["total"],
        },
        "cost": dataclasses.asdict(plan.cost) if plan.cost is not None else None,
        "comm_bytes": plan.comm,
        "model_parallel": [_layout_json(plan, layout) for layout in plan.layouts],
    }


def _layout_json(plan: Plan, layout: Layout) -> dict:
    mesh = layout.mesh
    found = {
        "backend": mesh.backend,
        "tp": mesh.tp,
        "dp_shard": mesh.shard,
        "dp_replicate": mesh.replicate,
        "pp": mesh.pp,
        "refusal": layout.refusal,
        "grad_accum": layout.grad_accum or None,
        "rows": [{**_row_json(plan, row), "comm_bytes": sent} for row, sent in zip(layout.rows, layout.comm)],
    }
    if isinstance(layout, PipelineLayout) and layout.pipe is not None:
        pipe = layout.pipe
        found |= {
            "schedule": pipe.schedule,
            "chunks_per_process": pipe.chunks,
            "bubble": float(pipe.bubble),
            "stage_layers": list(pipe.split),
        }
        for row, totals in zip(found["rows"], layout.gpu_totals):
            row["per_gpu_total_bytes"] = list(totals)
    return found


def _row_json(plan: Plan, row: MemoryEstimate) -> dict:
    return {
        "backend": row.backend,
        "gradient_checkpointing": row.checkpointing,
        "micro_batch": row.micro_batch,
        "per_gpu_bytes": row.per_gpu(),
        "loss_head_bytes": row.head,
        "model_state_bytes": dataclasses.asdict(row.states),
        "cpu_ram_bytes": row.cpu_ram,
        "fits": plan.fits(row),
        **_generation_json(row),
    }


def _generation_json(row: MemoryEstimate) -> dict:
    if row.generation is None:
        return {}
    return {
        "peak_phase": row.peak_phase,
        "generation_bytes": {**dataclasses.asdict(row.generation), "total": row.generation.total},
    }
