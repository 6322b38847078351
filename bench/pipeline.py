"""Pipeline parallelism against data parallelism: the step time of the same model, data and global batch
under DDP, FSDP and a 2-stage pipeline (GPipe, 1F1B, interleaved 1F1B), each 2 gloo CPU processes launched
by `accelerate launch`; the pipeline's measured idle share next to its schedule's theoretical bubble, and the
losses of every contender side by side. Round-robin repeats, each run a fresh launch. Writes its table
between the pipeline markers of bench/RESULTS.md and every run's figures to bench/raw_pipeline.json (also run
by `make bench`).

    python bench/pipeline.py [--repeats 2]
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import tempfile
from pathlib import Path

from common import LEARNING_RATE, ROOT, build_model_dir, write_data, write_results
from harness import run_from_command_line, run_process

from toolkit.train.metrics import read_metrics

BENCH = Path(__file__).resolve().parent
ACCELERATE = Path(sys.executable).parent / "accelerate"
BEGIN, END = "<!-- make bench pipeline: begin -->", "<!-- make bench pipeline: end -->"
PROCESSES = 2
GLOBAL_BATCH, MICRO_BATCH = 16, 4
LENGTH = 128
STEPS = 6
WARMUP = 2  # steps left out of every figure: the first builds the schedules and warms the allocator
# name: (accelerate config, pipeline overrides, model chunks a process holds); None: not a pipeline
CONTENDERS = {
    "ddp": ("ddp.yaml", None),
    "fsdp": ("fsdp.yaml", None),
    "pp gpipe": ("pp.yaml", ("gpipe", 1)),
    "pp 1f1b": ("pp.yaml", ("1f1b", 1)),
    "pp interleaved_1f1b": ("pp.yaml", ("interleaved_1f1b", 2)),
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def out_dir(name: str, work: Path) -> Path:
    return work / "out" / name.replace(" ", "-")


def command(name: str, work: Path) -> list[str]:
    config, pipe = CONTENDERS[name]
    cmd = [str(ACCELERATE), "launch", "--config_file", str(ROOT / "accelerate_configs" / config),
           "--num_processes", str(PROCESSES), "--main_process_port", str(free_port()),
           str(ROOT / "recipes" / "finetune_llm.py"), "--config", str(BENCH / "ftkit.yaml"),
           f"model.path={work / 'model'}", f"data.train={work / 'data.jsonl'}",
           f"output_dir={out_dir(name, work)}", "model.method=full",
           "data.packing=true", f"data.max_length={LENGTH}", f"train.max_steps={STEPS}",
           f"train.global_batch_size={GLOBAL_BATCH}", f"train.micro_batch_size={MICRO_BATCH}",
           f"train.learning_rate={LEARNING_RATE}", "train.log_every_steps=1", "train.save_every_steps=0",
           "eval.exact_match_samples=0", "eval.max_batches=1"]  # fmt: skip
    if pipe is not None:
        schedule, chunks = pipe
        cmd += [f"pipeline.size={PROCESSES}", f"pipeline.schedule={schedule}",
                f"pipeline.chunks_per_process={chunks}"]  # fmt: skip
    return cmd


def micro_batches(name: str) -> int:
    """Micro-batches of one process in one step: a pipeline's 2 processes share each micro-batch."""
    replicas = 1 if CONTENDERS[name][1] else PROCESSES
    return GLOBAL_BATCH // (MICRO_BATCH * replicas)


def theoretical_bubble(name: str) -> float | None:
    """The schedule's idle share with equal stages and no communication: (p-1)/(v*m+p-1), p stages of
    processes, m micro-batches, v model chunks a process (1 but for interleaved 1F1B)."""
    pipe = CONTENDERS[name][1]
    if pipe is None:
        return None
    p, v, m = PROCESSES, pipe[1], micro_batches(name)
    return (p - 1) / (v * m + p - 1)


def run_once(name: str, work: Path) -> dict:

    _, wall, _ = run_process(name, command(name, work), work)
    lines = [x for x in read_metrics(out_dir(name, work) / "metrics.jsonl") if "step_time_s" in x]
    measured = lines[WARMUP:]
    return {
        "step_s": [x["step_time_s"] for x in measured],
        "tokens": [round(x["tokens_per_s"] * x["step_time_s"]) for x in measured],
        "idle_frac": [x["pipeline_idle_frac"] for x in measured if "pipeline_idle_frac" in x],
        "loss": [x["loss"] for x in lines],
        "rank0_peak_mb": lines[-1]["peak_mem_mb"],
        "wall_s": wall,
    }


def summary(runs: list[dict]) -> dict:
    """Every measured step of every repeat pooled."""
    steps = [s for r in runs for s in r["step_s"]]
    idle = [f for r in runs for f in r["idle_frac"]]
    return {
        "step_s": statistics.median(steps),
        "fastest_s": min(steps),
        "tokens_per_s": sum(t for r in runs for t in r["tokens"]) / sum(steps),
        "idle_frac": statistics.median(idle) if idle else None,
        "loss": runs[0]["loss"][-1],
        "rank0_peak_mb": statistics.median(r["rank0_peak_mb"] for r in runs),
        "wall_s": statistics.median(r["wall_s"] for r in runs),
    }


def percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def table(results: dict[str, list[dict]]) -> str:
    reference = summary(results["ddp"])["step_s"]
    lines = [
        "| contender | micro-batches a step, each process | step time median (s) | fastest step (s) | "
        "vs ddp | tokens/s | idle share, measured (rank 0) | bubble, theory | loss at step "
        f"{STEPS} | rank 0 peak RSS (MB) | whole run (s) |",
        "|---" * 11 + "|",
    ]
    for name, runs in results.items():
        s = summary(runs)
        cells = [name, str(micro_batches(name)), f"{s['step_s']:.2f}", f"{s['fastest_s']:.2f}",
                 f"{s['step_s'] / reference:.2f}x", f"{s['tokens_per_s']:.0f}", percent(s["idle_frac"]),
                 percent(theoretical_bubble(name)), f"{s['loss']:.6f}", f"{s['rank0_peak_mb']:.0f}",
                 f"{s['wall_s']:.1f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def loss_agreement(results: dict[str, list[dict]]) -> str:
    """How far each contender's per-step losses lie from ddp's, over every step and repeat."""
    reference = results["ddp"][0]["loss"]
    gaps = {
        name: max(abs(a - b) for run in runs for a, b in zip(run["loss"], reference, strict=True))
        for name, runs in results.items()
    }
    worst = max(gaps, key=gaps.get)
    listed = ", ".join(f"{name} {gap:.1e}" for name, gap in gaps.items() if name != "ddp")
    return (
        f"- Losses: the largest difference from ddp's loss at any of the {STEPS} steps of any run is "
        f"{gaps[worst]:.1e} ({worst}); per contender: {listed}. ddp's loss at step {STEPS}: "
        f"{reference[-1]:.6f}."
    )


def run_section(repeats: int, machine) -> str:
    """Every contender `repeats` times round-robin; returns the markdown block it also writes."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_model_dir(work / "model")
        write_data(work / "data.jsonl")
        results: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
        for repeat in range(repeats):  # round-robin, so drift in machine speed hits every contender
            for name in CONTENDERS:
                results[name].append(run_once(name, work))
                print(f"[pipeline {repeat + 1}/{repeats}] {name}: {results[name][-1]}", flush=True)
    measured = (STEPS - WARMUP) * repeats
    head = (
        f"Machine: {machine()}. {repeats} runs of each contender; every figure pools steps {WARMUP + 1}-"
        f"{STEPS} of every run ({measured} steps a contender)."
    )
    block = "\n\n".join([head, table(results), loss_agreement(results)])
    write_results(BENCH / "RESULTS.md", block, (BEGIN, END))
    raw = {"machine": machine(), "runs": results, "summary": {n: summary(r) for n, r in results.items()}}
    (BENCH / "raw_pipeline.json").write_text(json.dumps(raw, indent=1))
    return block


if __name__ == "__main__":
    run_from_command_line(__doc__, run_section, repeats=2)
