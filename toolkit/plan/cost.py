"""What a fine-tune costs in time and money (`ftkit plan --tokens`), at a given throughput or one measured by
an earlier run on the same hardware."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import UserError
from toolkit.train.metrics import read_metrics


@dataclass(frozen=True)
class CostRequest:
    tokens: int
    """Tokens to train on (all epochs)."""
    tokens_per_s: float | None = None
    """Measured throughput of the whole machine."""
    from_run: str | None = None
    """Output dir of a run on the same hardware: its metrics.jsonl gives tokens_per_s."""
    price_per_gpu_hour: float | None = None


@dataclass(frozen=True)
class Cost:
    tokens: int
    tokens_per_s: float
    throughput_source: str
    wall_hours: float
    gpu_hours: float
    price_per_gpu_hour: float | None
    price: float | None
    """Total price (None without --price-per-gpu-hour)."""


def estimate_cost(cost: CostRequest, gpus: int) -> Cost:
    """Wall time, GPU-hours and price of training on `cost.tokens` at a given or measured throughput."""
    if cost.tokens <= 0:
        raise UserError(f"--tokens must be positive, got {cost.tokens}")
    if cost.tokens_per_s is not None:
        rate, source = cost.tokens_per_s, "--tokens-per-s"
    elif cost.from_run is not None:
        rate, source = measured_tokens_per_s(Path(cost.from_run)), f"median of {cost.from_run}/metrics.jsonl"
    else:
        raise UserError("--tokens needs a throughput: --tokens-per-s X or --from-run OUTPUT_DIR")
    if rate <= 0:
        raise UserError(f"tokens per second must be positive, got {rate}")
    wall_hours = cost.tokens / rate / 3600
    gpu_hours = wall_hours * gpus
    price = gpu_hours * cost.price_per_gpu_hour if cost.price_per_gpu_hour is not None else None
    return Cost(cost.tokens, rate, source, wall_hours, gpu_hours, cost.price_per_gpu_hour, price)


def measured_tokens_per_s(run_dir: Path) -> float:
    """Median tokens_per_s of a run's logged steps; the first step (allocation, warm-up) is left out."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"--from-run {run_dir}: no metrics.jsonl there")
    rates = [r["tokens_per_s"] for r in read_metrics(path) if isinstance(r.get("tokens_per_s"), (int, float))]
    if not rates:
        raise UserError(f"{path}: no tokens_per_s logged yet")
    return statistics.median(rates[1:] or rates)
