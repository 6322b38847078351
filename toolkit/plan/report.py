"""How `ftkit plan` shows a plan: a table for people, a JSON document for machines. The text's memory tables
are in `plan.tables`, its model-parallel part in `plan.layouts_report`."""

from __future__ import annotations

import dataclasses

from toolkit.launch.machine import GIB
from toolkit.plan import embedding, engine, memory
from toolkit.plan.estimate import Plan, fits, processes
from toolkit.plan.footprint import MemoryEstimate
from toolkit.plan.layouts_report import layouts_section
from toolkit.plan.longest import LIMIT, STEP
from toolkit.plan.memory import qlora_load_bytes
from toolkit.plan.parallel import Layout
from toolkit.plan.pipeline import PipelineLayout
from toolkit.plan.tables import generation_table, setups_table


def render_text(plan: Plan) -> str:
    """The plan as the terminal shows it: model, setup, per-GPU memory by backend, recommendation, cost."""
    lines = [*_header(plan), "", *setups_table(plan), *generation_table(plan), "", *_recommendation(plan)]
    lines += _margin_note(plan)
    lines += _head_note(plan)
    lines += _sequence_note(plan)
    lines += _qlora_loading(plan)
    lines += layouts_section(plan)
    lines += _longest(plan)
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
    experts = " and the routed experts" if c.experts else ""
    trained = "all weights" if c.method == "full" else f"LoRA r={c.lora_r} on all linear layers{experts}"
    autocast = "bf16 autocast" if p.mixed == "bf16" else "no autocast"
    base = "4-bit NF4 base" if c.method == "qlora" else f"weights {p.weights}"
    if r.head is None:
        head = "no LM head"
    elif memory.full_logits(c, r.head):
        head = "full logits"
    else:
        head = f"chunked loss head ({r.chunk_tokens} tokens)"
    return [
        f"model    {r.model} ({c.source}): {c.model_type}, {c.layers} layers, hidden {c.hidden}, "
        f"{c.heads} heads ({c.kv_heads} kv), vocab {c.vocab:,}",
        *_layers(c),
        f"params   {c.total:,} total, {c.trainable:,} trainable "
        f"({100 * c.trainable / c.total:.2f}%: {trained})",
        f"setup    {c.method} on {r.gpus} GPU x {r.gpu_mem:g} GiB | {base}, {autocast} | "
        f"seq {r.seq_len} | global batch {r.global_batch} | {head}"
        + (" | activations offloaded to CPU RAM" if r.activation_offload else ""),
        *_experts(c),
        _tokens(plan),
        *_vision(plan),
        f"compute  {plan.flops_per_token / 1e9:.2f} GFLOP per trained token (see toolkit/model/flops.py)",
        *_grpo_setup(plan),
        *_embed_setup(plan),
    ]


def _layers(c) -> list[str]:
    """A hybrid's layer kinds, or multi-head latent attention's cache, where the generation cache differs
    from K and V per head and token."""
    if not (c.state_per_sequence or c.latent_cache):
        return []
    latent = f", multi-head latent attention caching {c.cache[0][0]} a token" if c.latent_cache else ""
    return [f"layers   {c.layer_kinds}{latent}"]


def _tokens(plan: Plan) -> str:
    """What a step's tokens are: packed rows full of examples, or examples padded to their micro-batch's
    longest (a hybrid's packed rows keep each example's recurrent state its own)."""
    r, c = plan.request, plan.counts
    rows = r.global_batch * r.rows_per_example
    if not r.packing:
        hint = " (--packing fills the rows with whole examples)" if r.objective == "sft" else ""
        return (
            f"tokens   at most {rows} rows x {r.row_tokens} = {r.tokens_per_step:,} a step: each example "
            f"padded to its micro-batch's longest{hint}"
        )
    state = f"; its {c.recurrent} layers start each example from an empty state" if c.recurrent else ""
    return (
        f"tokens   {rows} packed rows x {r.row_tokens} = {r.tokens_per_step:,} a step, every one an "
        f"example's but the rows' unfilled ends{state}"
    )


def _experts(c) -> list[str]:
    """A mixture of experts' line: what a token goes through, and how QLoRA stores the experts."""
    if not c.experts:
        return []
    kept = (
        f"; QLoRA stores its {c.expert_params:,} expert parameters in 4-bit (4.5 bits a weight with their "
        "scales), loading them through CPU RAM in 16-bit"
        if c.method == "qlora"
        else ""
    )
    return [
        f"experts  {c.experts} routed experts a layer, {c.experts_per_token} per token: {c.active:,} "
        f"parameters active per token{kept}"
    ]


def _vision(plan: Plan) -> list[str]:
    """A vision-language model's parts and the images each row holds."""
    c, rows = plan.counts, plan.images
    v = c.vision
    if v is None:
        return []
    language = (c.total - v.tower - v.projector, c.trainable - v.tower_trainable - v.projector_trainable)
    named = {"tower": (v.tower, v.tower_trainable), "projector": (v.projector, v.projector_trainable)}
    parts = [_part(name, *numbers) for name, numbers in {**named, "language model": language}.items()]
    sixteen = "; QLoRA leaves the tower and projector in 16-bit" if c.method == "qlora" else ""
    lines = ["parts    " + " | ".join(parts) + sixteen]
    if not rows.images:
        return [*lines, "images   none (--images-per-row 0): the tower's weights only"]
    if v.resolution == "fixed":
        size = "a fixed count, whatever the image's size"
    else:
        size = f"{rows.max_pixels:,} pixels each" if rows.max_pixels else "each as large as the row allows"
    kept = (
        f"the last {v.kept_blocks} of its {v.blocks} blocks keep activations for backward"
        if v.kept_blocks
        else "frozen: forward only, nothing kept for backward"
    )
    return [
        *lines,
        f"images   {rows.images} per row x {rows.tokens:,} tokens ({size}) = {rows.images * rows.tokens:,} "
        f"of the {plan.request.row_tokens} tokens of a row; the tower reads {rows.patches:,} patches of "
        f"{v.patch}x{v.patch} pixels an image ({kept}; see toolkit/plan/images.py)",
    ]


def _part(name: str, total: int, trained: int) -> str:
    return f"{name} {total:,} " + (f"({trained:,} trained)" if trained else "frozen")


def _embed_setup(plan: Plan) -> list[str]:
    """The embedding recipe's rows, head and GradCache (`plan.embedding`)."""
    r, row = plan.request, plan.choice
    if r.objective != "embed":
        return []
    micro = row.micro_batch if row else None
    procs = processes(row.backend, r.gpus) if row else 1
    return [embedding.describe(r, plan.counts.hidden, micro, procs)]


def _grpo_setup(plan: Plan) -> list[str]:
    """The round a GRPO plan assumes, and where its reference comes from."""
    r = plan.request
    if r.objective != "grpo":
        return []
    if r.beta == 0:
        reference = "beta 0: no reference"
    elif r.reference_model:
        reference = f"beta {r.beta:g}: a separate reference model"
    else:
        reference = f"beta {r.beta:g}: reference = the policy with its adapter off (no extra memory)"
    completions = r.global_batch * r.steps_per_generation
    rounds = (
        f"{r.generations} completions a prompt, {completions} a round (global batch {r.global_batch} x "
        f"{r.steps_per_generation} steps)"
    )
    if plan.engine is not None:
        peak = plan.choice.per_gpu()["total"] - plan.choice.engine if plan.choice else None
        return [
            f"grpo     {rounds}, sampled by the vLLM engine (the training GPUs only score them); prompt "
            f"{r.seq_len} + {r.max_new_tokens} new tokens a row; {reference}",
            *engine.report_lines(plan.engine, r, peak, completions),
        ]
    batch = f"{r.generation_batch} at once" if r.generation_batch else "its whole share at once"
    return [
        f"grpo     {rounds}, each GPU generating {batch}; prompt {r.seq_len} + {r.max_new_tokens} new tokens "
        f"a row; gather for generation {'on' if r.gather_for_generation else 'off'}; {reference}"
    ]


def _margin_note(plan: Plan) -> list[str]:
    """The backends that fit only by eating into the margin the plan keeps free on each GPU."""
    r = plan.request
    if plan.engine is not None and not plan.engine.starts:
        return []  # nothing fits whatever the margin: the engine does not start
    fitting = {row.backend for row in plan.rows if plan.fits(row)}
    tight = [
        row for row in plan.rows if row.backend not in fitting and fits(row, r, margin=0.0) and r.margin > 0
    ]
    if not tight:
        return []
    listed = ", ".join(f"{row.backend} {row.per_gpu()['total'] / GIB:.1f} GiB" for row in tight)
    return [
        f"fits only without the {r.margin:.0%} margin (--margin 0; fragmentation may then run it out of "
        f"memory): {listed}"
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
            + _shrink_hint(plan, smallest)
        ]
    procs = 1 if row.backend == "single" else r.gpus
    ckpt = "on" if row.checkpointing else "off"
    lines = [
        f"recommended: accelerate_configs/{row.backend}.yaml, gradient checkpointing {ckpt}, micro-batch "
        f"{row.micro_batch} x GA {plan.grad_accum(row)} x {procs} GPU = global batch {r.global_batch}",
        f"  {row.per_gpu()['total'] / GIB:.1f} of {r.gpu_mem:g} GiB {_where(row)}{_phases(row)}, "
        f"{row.cpu_ram / GIB:.1f} GiB CPU RAM",
    ]
    if plan.images is not None and plan.images.images:
        lines.append(
            f"  of which images {row.images / GIB:.2f} GiB (pixels, what the tower and projector keep)"
        )
    if plan.command:
        lines.append(f"  {plan.command}")
    return lines


def _shrink_hint(plan: Plan, smallest: MemoryEstimate) -> str:
    """The end of the nothing-fits line: what else shrinks a GRPO setup."""
    if plan.engine is not None and plan.engine.shared:
        return (
            "; --engine own puts the engine on a GPU of its own, a lower --gpu-memory-utilization shrinks it."
        )
    if smallest.peak_phase == "generation":
        return "; a smaller --generation-batch or --max-new-tokens shrinks the generation phase."
    return "."


def _where(row: MemoryEstimate) -> str:
    """Per GPU, or the main process's GPU with the shared engine on it, which the others do not hold."""
    if not row.engine:
        return "per GPU"
    others = (row.per_gpu()["total"] - row.engine) / GIB
    return f"on the main process's GPU (the engine {row.engine / GIB:.1f} of it; the others {others:.1f})"


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


def _sequence_note(plan: Plan) -> list[str]:
    """One line when nothing fits without offloading the model states but a sequence-parallel layout does."""
    if plan.choice is not None and not plan.choice.states.in_cpu_ram:
        return []
    for layout in plan.layouts:
        for row, a2a in zip(layout.rows, layout.all_to_all):
            if plan.fits(row) and not row.states.in_cpu_ram:
                ckpt = "on" if row.checkpointing else "off"
                return [
                    f"  without offload: {layout.label} fits, gradient checkpointing {ckpt}, "
                    f"{row.per_gpu()['total'] / GIB:.1f} of {plan.request.gpu_mem:g} GiB per GPU, all-to-all "
                    f"{a2a / GIB:.1f} GiB per GPU per step (accelerate_configs/{layout.mesh.backend}.yaml)"
                ]
    return []


def _longest(plan: Plan) -> list[str]:
    """--longest-seq: each setup's and layout's longest sequence, flagged past the model's positions."""
    if plan.longest is None:
        return []
    positions = plan.counts.positions
    beyond = f"; *: past the model's max_position_embeddings, {positions:,}" if positions else ""
    lines = [
        "",
        f"longest  --seq-len that fits {plan.request.gpu_mem:g} GiB per GPU at micro-batch "
        f"{plan.rows[0].micro_batch}, with the better grad ckpt option (multiples of {STEP} up to "
        f"{LIMIT:,}{beyond})",
    ]
    for name, tokens in plan.longest.items():
        shown = "none" if tokens == 0 else f"{tokens:,}" + ("+" if tokens == LIMIT else "")
        flag = " *" if positions and tokens > positions else ""
        lines.append(f"  {name:30}{shown:>10}{flag}")
    return lines


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
        "tokens_per_step": plan.request.tokens_per_step,
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
        "longest_seq": plan.longest,
        "images": None if plan.images is None else dataclasses.asdict(plan.images),
        "engine": _engine_json(plan),
    }


def _engine_json(plan: Plan) -> dict | None:
    """The vLLM engine on its GPU (grpo.generation vllm), in bytes."""
    sampler = plan.engine
    if sampler is None:
        return None
    derived = {"kv_cache": sampler.kv_cache, "rows": sampler.rows, "starts": sampler.starts}
    return {**dataclasses.asdict(sampler), **derived}


def _layout_json(plan: Plan, layout: Layout) -> dict:
    mesh = layout.mesh
    found = {
        "backend": mesh.backend,
        "tp": mesh.tp,
        "dp_shard": mesh.shard,
        "dp_replicate": mesh.replicate,
        "pp": mesh.pp,
        "sp": mesh.sp,
        "zero": mesh.zero or None,
        "config_file": f"accelerate_configs/{mesh.backend}.yaml",
        "refusal": layout.refusal,
        "grad_accum": layout.grad_accum or None,
        "rows": [{**_row_json(plan, row), "comm_bytes": sent} for row, sent in zip(layout.rows, layout.comm)],
    }
    for row, a2a in zip(found["rows"], layout.all_to_all):
        row["all_to_all_bytes"] = a2a
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
        "image_bytes": row.images,
        **_generation_json(row),
    }


def _generation_json(row: MemoryEstimate) -> dict:
    if row.generation is None:
        return {}
    return {
        "peak_phase": row.peak_phase,
        "generation_bytes": {**dataclasses.asdict(row.generation), "total": row.generation.total},
    }
