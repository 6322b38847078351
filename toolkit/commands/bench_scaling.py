"""`ftkit bench-scaling`: the same recipe and global batch at several process counts, and how well it scales.

Speedup is throughput at N processes over throughput at the smallest count (1 process when measured), and
efficiency is speedup / (N / smallest count): 100% when every added device adds its full share.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from accelerate.utils.other import get_free_port

from toolkit.errors import UserError
from toolkit.train.metrics import read_metrics


@dataclass(frozen=True)
class ScalingPoint:
    processes: int
    tokens_per_s: float
    """Real (non-padding) tokens per second of the whole run, over the timed steps."""
    tokens_per_s_per_device: float
    step_time_s: float
    """Median step time of the timed steps."""
    timed_steps: int
    speedup: float
    efficiency: float


def parse_counts(text: str) -> list[int]:
    """ "1,2,4" -> [1, 2, 4]: positive, distinct, ascending."""
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise UserError(f"--nprocs {text}: expected process counts like 1,2") from None
    if not counts or counts[0] < 1:
        raise UserError(f"--nprocs {text}: expected positive process counts like 1,2")
    return counts


def launch_command(
    config_file: str, processes: int, recipe: Path, recipe_config: str | None, run_dir: Path, overrides
) -> list[str]:
    """`accelerate launch` of the recipe at `processes` processes, writing into its own `run_dir`."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        config_file,
        "--num_processes",
        str(processes),
        "--main_process_port",
        str(get_free_port()),
        str(recipe),
        *(["--config", recipe_config] if recipe_config else []),
        f"output_dir={run_dir}",
        "train.overwrite=true",
        "eval.exact_match_samples=0",  # scaling is about the training steps; override to keep it
        *overrides,
    ]


def timed_throughput(metrics_path: Path, warmup_steps: int) -> tuple[float, float, int]:
    """(tokens/s, median step time, steps timed) over the logged steps after the first `warmup_steps`."""
    lines = [r for r in read_metrics(metrics_path) if "tokens_per_s" in r and r["step"] > warmup_steps]
    if not lines:
        raise UserError(
            f"{metrics_path}: no training step logged after step {warmup_steps}; run more steps "
            "(train.max_steps) or log every step (train.log_every_steps=1)"
        )
    seconds = sum(r["step_time_s"] for r in lines)
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in lines)
    times = sorted(r["step_time_s"] for r in lines)
    return tokens / seconds, times[len(times) // 2], len(lines)


def scaling_points(measured: dict[int, tuple[float, float, int]]) -> list[ScalingPoint]:
    """Speedup and efficiency of each process count relative to the smallest one."""
    base_n = min(measured)
    base_rate = measured[base_n][0]
    points = []
    for n, (rate, step_time, steps) in sorted(measured.items()):
        speedup = rate / base_rate
        points.append(ScalingPoint(n, rate, rate / n, step_time, steps, speedup, speedup / (n / base_n)))
    return points


def run_scaling(
    config_file: str,
    counts: list[int],
    overrides: list[str],
    out: Path,
    recipe: Path,
    recipe_config: str | None,
    warmup_steps: int,
    echo=print,
) -> list[ScalingPoint]:
    """Launch the recipe at each process count in turn (each run in out/nprocs-N) and measure it."""
    if not Path(config_file).is_file():
        raise UserError(f"--config_file {config_file}: no such file")
    if not recipe.is_file():
        raise UserError(f"--recipe {recipe}: no such file (run from the ftkit checkout, or pass --recipe)")
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    measured = {}
    for n in counts:
        run_dir = out / f"nprocs-{n}"
        log_path = out / f"nprocs-{n}.log"
        echo(f"running {n} process(es): {run_dir} (log: {log_path})")
        command = launch_command(config_file, n, recipe, recipe_config, run_dir, overrides)
        with log_path.open("w") as log:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
        if code != 0:
            last = _error_line(log_path)
            raise UserError(f"the run with {n} process(es) failed (exit {code}): {last} — see {log_path}")
        measured[n] = timed_throughput(run_dir / "metrics.jsonl", warmup_steps)
    points = scaling_points(measured)
    (out / "scaling.json").write_text(json.dumps([asdict(p) for p in points], indent=2) + "\n")
    return points


def render(points: list[ScalingPoint], config_file: str, on_cpu: bool) -> str:
    header = f"scaling of {config_file}, same global batch at every process count"
    if on_cpu:
        header += " (CPU processes over gloo: a check of the tool, not GPU numbers)"
    lines = [
        header,
        f"{'procs':>5}  {'tokens/s':>10}  {'tokens/s/dev':>12}  {'step time':>9}  {'speedup':>7}  "
        f"{'efficiency':>10}",
    ]
    for p in points:
        lines.append(
            f"{p.processes:>5}  {p.tokens_per_s:>10,.0f}  {p.tokens_per_s_per_device:>12,.0f}  "
            f"{p.step_time_s:>8.3f}s  {p.speedup:>6.2f}x  {p.efficiency:>10.0%}"
        )
    lines.append(f"timed: {points[0].timed_steps} step(s) per run after the warm-up steps")
    return "\n".join(lines)


def _error_line(path: Path) -> str:
    """The recipe's own error line if it wrote one (the launcher's summary follows it), else the last line."""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if ": error: " in line]
    return (errors or lines or ["no output"])[-1]
