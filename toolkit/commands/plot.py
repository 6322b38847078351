"""`ftkit plot`: loss, learning rate and throughput against step for one or more runs, as one PNG."""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import UserError
from toolkit.train.metrics import read_metrics

# (metric key, panel title); the loss panel also draws eval_loss.
PANELS = (("loss", "loss (eval dashed)"), ("lr", "learning rate"), ("tokens_per_s", "tokens / s"))
# Preference-tuning runs also get these, beside the loss (their eval_* values dashed).
PREFERENCE_PANELS = (
    ("reward_accuracy", "reward accuracy (eval dashed)"),
    ("reward_margin", "reward margin (eval dashed)"),
)


def panels_for(runs: list[tuple[str, list[dict]]]) -> tuple[tuple[str, str], ...]:
    """The fixed panels (preference runs' beside the loss), then one per benchmark score (eval.benchmarks)."""
    preference = any("reward_accuracy" in r or "eval_reward_accuracy" in r for _, rs in runs for r in rs)
    fixed = (PANELS[0], *PREFERENCE_PANELS, *PANELS[1:]) if preference else PANELS
    scores = sorted({key for _, rs in runs for r in rs for key in r if key.startswith("bench/")})
    return (*fixed, *((key, key.removeprefix("bench/")) for key in scores))


def read_run(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl; a missing, empty or malformed file is the user's to fix."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl (is it a run's output_dir?)")
    records = [r for r in read_metrics(path) if isinstance(r, dict) and "step" in r]
    if not records:
        raise UserError(f"{path}: no metrics logged yet")
    return records


def labels_for(run_dirs: list[Path]) -> list[str]:
    """Directory names, or whole paths when two runs share a name."""
    names = [d.resolve().name for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]


def plot_runs(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Write the panels for every run, overlaid, to `out` (by default metrics.png beside the first run's
    metrics.jsonl) and return the path written."""
    run_dirs = [Path(d) for d in run_dirs]
    runs = [(label, read_run(d)) for label, d in zip(labels_for(run_dirs), run_dirs, strict=True)]
    out = Path(out) if out is not None else run_dirs[0] / "metrics.png"
    figure = draw_runs(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    return out


def draw_runs(runs: list[tuple[str, list[dict]]]):
    """A matplotlib Figure with one panel per metric and one colour per (label, records) run."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("ftkit plot needs matplotlib: pip install 'ftkit[plot]'") from None
    panels = panels_for(runs)
    # no pyplot: Agg renders it, no global state
    figure = Figure(figsize=(5 * len(panels), 4.2), layout="constrained")
    axes = figure.subplots(1, len(panels))
    for index, (label, records) in enumerate(runs):
        colour = f"C{index % 10}"
        for ax, (key, _) in zip(axes, panels, strict=True):
            _draw(ax, records, key, colour, label)
            if key == "loss" or key.startswith("reward_"):
                _draw(ax, records, f"eval_{key}", colour, None, linestyle="--", marker="o")
    for ax, (key, title) in zip(axes, panels, strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    axes[0].legend(loc="upper right")
    return figure


def _draw(ax, records: list[dict], key: str, colour: str, label: str | None, **style) -> None:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    if points:
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, color=colour, label=label, linewidth=1.5, markersize=4, **style)
