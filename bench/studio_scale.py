"""`ftkit studio` at scale: a runs folder of 500 runs listed, and a 200,000-line metrics.jsonl plotted,
each timed through the app's own routes (the request, the reading of the folders, the rendering) as the page
asks for them. The runs are written like a run leaves its folder (its resolved config, a metrics file, its
checkpoints, half of them finished); the metrics file has a training line per step and an eval line every
500 steps. Cold: a fresh app (nothing read yet); warm: the same app asked again (what the page's refresh
every second costs). Writes its table between the studio markers of bench/RESULTS.md.

    python bench/studio_scale.py [--repeats 5]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from common import write_results
from fastapi.testclient import TestClient
from harness import run_from_command_line

from toolkit.checkpoint.rundir import MARKER
from toolkit.config import load_config
from toolkit.studio.app import create_app
from toolkit.studio.guard import Roots, allowed_hosts
from toolkit.typed_yaml import save_config

BENCH = Path(__file__).resolve().parent
BEGIN, END = "<!-- make bench studio: begin -->", "<!-- make bench studio: end -->"
RUNS, STEPS_EACH, METRICS_LINES = 500, 100, 200_000
BASE = "http://127.0.0.1:7860"


def train_line(step: int) -> str:
    return json.dumps(
        {"step": step, "loss": 2.0 + 1.0 / step, "grad_norm": 1.5, "lr": 2e-4, "tokens_seen": 512 * step,
         "tokens_per_s": 1500.0, "step_time_s": 0.34, "peak_mem_mb": 630.0, "time": 1.7e9 + step}
    )  # fmt: skip


def write_runs(root: Path) -> None:
    config = load_config(None, [])
    for i in range(RUNS):
        run_dir = root / f"run-{i:03d}"
        (run_dir / "checkpoints" / "step-50").mkdir(parents=True)
        (run_dir / MARKER).write_text("{}\n")
        save_config(config, run_dir / "config.yaml")
        lines = [json.dumps({"step": 0, "eval_loss": 6.0, "exact_match": 0.0, "time": 1.7e9})]
        lines += [train_line(s) for s in range(1, STEPS_EACH + 1)]
        if i % 2:
            lines.append(
                json.dumps({"step": STEPS_EACH, "eval_loss": 1.8, "exact_match": 0.4, "time": 1.8e9})
            )
            (run_dir / "final").mkdir()
        (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def write_long_metrics(root: Path) -> None:
    run_dir = root / "long"
    run_dir.mkdir(parents=True)
    (run_dir / MARKER).write_text("{}\n")
    with (run_dir / "metrics.jsonl").open("w") as out:
        for step in range(1, METRICS_LINES + 1):
            out.write(train_line(step) + "\n")
            if step % 500 == 0:
                out.write(json.dumps({"step": step, "eval_loss": 2.0, "time": 1.7e9 + step}) + "\n")


def timed(client: TestClient, path: str) -> tuple[float, object]:
    started = time.perf_counter()
    response = client.get(path)
    elapsed = time.perf_counter() - started
    assert response.status_code == 200, response.text
    return elapsed, response


def measure(root: Path, path: str, repeats: int) -> tuple[list[float], list[float], object]:
    cold, warm = [], []
    for _ in range(repeats):
        app = create_app(Roots(root.resolve(), root.resolve()), None, allowed_hosts("127.0.0.1", 7860))
        with TestClient(app, base_url=BASE) as client:
            seconds, response = timed(client, path)
            cold.append(seconds)
            warm.append(timed(client, path)[0])
    return sorted(cold), sorted(warm), response


def spread(values: list[float]) -> str:
    return f"{values[0]:.3f} / {statistics.median(values):.3f} / {values[-1]:.3f}"


def run_section(repeats: int, machine) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_runs(root / "many")
        write_long_metrics(root / "one")
        list_cold, list_warm, listed = measure(root / "many", "/fragment/runs", repeats)
        plot_cold, plot_warm, plotted = measure(root / "one", "/api/metrics/long", repeats)
    rows = listed.text.count("<tr data-run=")
    loss = plotted.json()["series"]["loss"]
    assert rows == RUNS and loss[-1] == [METRICS_LINES, 2.0 + 1.0 / METRICS_LINES], (rows, loss[-1])
    block = "\n".join(
        [
            f"Machine: {machine()}. {repeats} fresh apps each, through the app's routes (FastAPI's test "
            "client: no network); seconds as min / median / max.",
            "",
            "| what | cold, s | warm, s | what came back |",
            "|---|---|---|---|",
            f"| runs list of {RUNS} runs (`/fragment/runs`) | {spread(list_cold)} | {spread(list_warm)} | "
            f"{rows} rows, {len(listed.text) / 1024:.0f} KiB of HTML |",
            f"| metrics.jsonl of {METRICS_LINES:,} steps (`/api/metrics/NAME`) | {spread(plot_cold)} | "
            f"{spread(plot_warm)} | {len(loss)} loss points, the last exact (step {loss[-1][0]:,}) |",
        ]
    )
    write_results(BENCH / "RESULTS.md", block, (BEGIN, END))
    return block


if __name__ == "__main__":
    run_from_command_line(__doc__, run_section, 5)
