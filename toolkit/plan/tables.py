"""The per-GPU memory tables of `ftkit plan`'s text: the data-parallel setups', GRPO's generation phase, and
the row and heading format the model-parallel table (`plan.layouts_report`) shares."""

from __future__ import annotations

from toolkit.launch.machine import GIB
from toolkit.plan.estimate import Plan
from toolkit.plan.footprint import MemoryEstimate

COLUMNS = ("weights", "lora", "grads", "optimizer", "activations", "overhead", "total")
HEADINGS = ("weights", "lora", "grads", "optim", "activ", "other", "total")
GENERATION_COLUMNS = ("resident", "gathered", "kv_cache", "logits", "prefill", "overhead")
GENERATION_HEADINGS = ("states", "gathered", "kv cache", "logits", "prefill", "other", "total")
PHASES = {"training": "train", "generation": "gen"}


def setups_table(plan: Plan) -> list[str]:
    """Every data-parallel setup at the rows' micro-batch, one line per backend and checkpointing option."""
    limit = f"fits {plan.request.gpu_mem:g} GiB"
    micro = plan.rows[0].micro_batch
    head = heading(plan, "per GPU (GiB), micro-batch " + str(micro))
    return [head + f"{'CPU RAM':>9}  {limit}", *(row_line(plan, row, row.backend) for row in plan.rows)]


def heading(plan: Plan, title: str) -> str:
    """The start of a table's heading line: its title, then the per-GPU columns the rows fill."""
    headings = (*HEADINGS[:-1], "engine", HEADINGS[-1]) if engine_shares(plan) else HEADINGS
    head = f"{title:33}" + "".join(f"{h:>7}" for h in headings)
    return head + (f"{'peak':>6}" if generates(plan) else "")


def engine_shares(plan: Plan) -> bool:
    """Whether the vLLM engine sits on the main process's training GPU, which adds its column."""
    return plan.engine is not None and plan.engine.shared


def generates(plan: Plan) -> bool:
    """Whether the plan has a generation phase (GRPO), which adds the peak column and its own table."""
    return plan.request.generation_round() is not None


def row_line(plan: Plan, row: MemoryEstimate, name: str, extra: str = "", note: str = "") -> str:
    """One setup's line: its parts per GPU and CPU RAM in GiB, the caller's `extra` cells, whether it fits,
    then the caller's `note`."""
    parts = row.per_gpu()
    name = f"{name:13} grad ckpt {'on ' if row.checkpointing else 'off'}"
    columns = (*COLUMNS[:-1], "engine", COLUMNS[-1]) if engine_shares(plan) else COLUMNS
    cells = "".join(f"{parts.get(k, 0) / GIB:7.1f}" for k in columns)
    cells += f"{PHASES[row.peak_phase]:>6}" if generates(plan) else ""
    notes = [text for text in ("states in CPU RAM" if row.states.in_cpu_ram else "", note) if text]
    end = f"  ({'; '.join(notes)})" if notes else ""
    return f"{name:33}{cells}{row.cpu_ram / GIB:9.1f}{extra}  {'yes' if plan.fits(row) else 'no'}{end}"


def generation_table(plan: Plan) -> list[str]:
    """GRPO's generation phase on each setup: what stays from training and what generating adds."""
    if not generates(plan):
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
