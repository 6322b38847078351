"""bench/GPU.md from the GPU check's result lines: one section per machine and day, one table per part."""

from __future__ import annotations

HEAD_KEYS = ("device", "gpus", "memory_gib", "driver", "cuda", "torch", "date", "smoke")
SKIPPED = set(HEAD_KEYS) | {"part", "case", "losses"}
TITLES = {
    "startup": "Time to the first step, evaluation first: cold, and warm from the run's compile cache",
    "large": "The 8B shape under the defaults (LoRA r16, 2,048 tokens x 1, compiled blocks, fused head)",
    "plan": "The plan against the run (predicted / measured per-GPU memory; target 0.95-1.10)",
    "speed": "ftkit against TRL's SFTTrainer (LoRA r16, packing; bf16 on a GPU, fp32 in smoke mode)",
    "compile": "Compiled blocks and flex attention (the defaults) against the eager forward on SDPA",
    "paths": "CUDA paths, each against the baseline run",
    "multi": "Several GPUs",
}


def render(rows: list[dict], findings: str = "") -> str:
    """Markdown for `rows`: machines in the order their first row came, parts in the order run; then
    `findings` (bench/gpu_findings.md: what the runs disproved, fixed or left open, kept by hand)."""
    lines = [
        "# ftkit on GPUs",
        "",
        "Written by `make gpu-check` (`bench/gpu_check.py`): each section is one machine on one day, so",
        "results from different cards stand side by side. Figures come from the runs' own `metrics.jsonl`",
        "(peak memory is `torch.cuda.max_memory_allocated`; `measured` adds the allocator's reserve and",
        "what lies outside it, the CUDA context). What the runs disproved, and what was done about it, is at",
        "the end (kept in `bench/gpu_findings.md`).",
    ]
    for head, group in _groups(rows, HEAD_KEYS).items():
        lines += ["", f"## {_heading(dict(head))}", ""]
        if dict(head).get("smoke"):
            lines += [
                "Smoke mode: no GPU was found, tiny shapes ran on the CPU; no figure is a GPU measurement.",
                "",
            ]
        for (part,), part_rows in _groups(group, ("part",)).items():
            lines += [f"### {TITLES.get(part, part)}", "", *_table(part_rows), ""]
    if findings.strip():
        lines += ["", findings.strip()]
    return "\n".join(lines).rstrip() + "\n"


def _groups(rows: list[dict], keys: tuple[str, ...]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(
            tuple((k, row.get(k)) for k in keys) if len(keys) > 1 else (row.get(keys[0]),), []
        ).append(row)
    return groups


def _heading(head: dict) -> str:
    parts = [str(head.get("device")), f"{head.get('gpus')} GPU(s)"]
    if head.get("memory_gib"):
        parts.append(f"{head['memory_gib']} GiB")
    parts += [f"driver {head.get('driver')}", f"CUDA {head.get('cuda')}", f"torch {head.get('torch')}"]
    return f"{head.get('date')}: " + ", ".join(parts)


def _table(rows: list[dict]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in SKIPPED and k not in columns]
    lines = ["| case | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for row in rows:
        lines.append(f"| {row['case']} | " + " | ".join(_cell(row.get(k)) for k in columns) + " |")
    return lines


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value).replace("|", "/")
