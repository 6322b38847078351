"""Two models' scores side by side: each metric for the base and the fine-tuned model, the difference and
its standard error, and a drop of more than two standard errors marked as forgetting."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from toolkit.evaluation.harness import Score

FORGETTING_SE = 2.0  # a drop this many standard errors of the difference is marked


@dataclass(frozen=True)
class Row:
    task: str
    metric: str
    tuned: float
    base: float | None
    diff: float | None
    diff_stderr: float | None
    forgetting: bool


def rows(tuned: list[Score], base: list[Score] | None) -> list[Row]:
    """One row per metric of the fine-tuned model, with the base's where it was scored. The difference's
    standard error treats the two scores as independent (each model's own stderr, in quadrature)."""
    by_key = {(s.task, s.metric): s for s in base or []}
    out = []
    for score in tuned:
        other = by_key.get((score.task, score.metric))
        if other is None:
            out.append(Row(score.task, score.metric, score.value, None, None, None, False))
            continue
        diff = score.value - other.value
        se = math.hypot(score.stderr, other.stderr) if None not in (score.stderr, other.stderr) else None
        worse = -diff if score.higher_is_better else diff
        forgetting = se is not None and worse > FORGETTING_SE * se and worse > 0
        out.append(Row(score.task, score.metric, score.value, other.value, diff, se, forgetting))
    return out


def markdown(table: list[Row], tuned_name: str, base_name: str | None) -> str:
    """The table as Markdown (what `ftkit eval` prints and writes to eval/<time>.md)."""
    head = ["task", "metric", "fine-tuned"] + (["base", "difference", ""] if base_name else [])
    lines = [f"fine-tuned: {tuned_name}" + (f"; base: {base_name}" if base_name else ""), ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table:
        cells = [row.task, row.metric, f"{row.tuned:.4f}"]
        if base_name:
            base = "" if row.base is None else f"{row.base:.4f}"
            diff = "" if row.diff is None else f"{row.diff:+.4f}"
            if row.diff_stderr is not None:
                diff += f" ± {row.diff_stderr:.4f}"
            cells += [base, diff, "forgetting" if row.forgetting else ""]
        lines.append("| " + " | ".join(cells) + " |")
    if base_name:
        lines += ["", f"forgetting: a drop of more than {FORGETTING_SE:g} standard errors of the difference"]
    return "\n".join(lines) + "\n"


def as_json(table: list[Row]) -> list[dict]:
    return [asdict(row) for row in table]
