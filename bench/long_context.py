"""Long sequences: one process against Ulysses sequence parallelism (sp=2, DeepSpeed ZeRO-2) on the SFT
recipe, both on the same long rows and global batch, each a fresh `accelerate launch`: real tokens/s, every
rank's peak RSS at the long length and at a short one (the difference is what the activations add), the
per-step losses side by side, and the share of sp's step time spent inside its all-to-all exchange.
Round-robin repeats. Writes its table between the long-context markers of bench/RESULTS.md and every run's
figures to bench/raw_long_context.json (also run by `make bench`).

    python bench/long_context.py [--repeats 2]
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import LEARNING_RATE, ROOT, TOKENIZER_DIR, build_model_dir, sentences, write_results
from harness import run_from_command_line

from toolkit.train.metrics import read_metrics

BENCH = Path(__file__).resolve().parent
ACCELERATE = Path(sys.executable).parent / "accelerate"
BEGIN, END = "<!-- make bench long-context: begin -->", "<!-- make bench long-context: end -->"
LONG, SHORT = 4096, 256  # tokens a row; every row of the data is longer than LONG and truncated to it
GLOBAL_BATCH, MICRO_BATCH = 2, 1  # one process: 2 micro-batches a step; sp=2: 1 row a process, both shared
STEPS = 4
WARMUP = 1  # steps left out of every figure but the loss: the first warms the allocator and the exchange
ROWS = 16
# name: (accelerate config, processes, threads a process). Both use the machine's 2 cores: the launcher gives
# each process of a multi-process run one thread, and a lone process one too unless told otherwise.
CONTENDERS = {"one process": ("single.yaml", 1, 2), "sp=2": ("sp.yaml", 2, 1)}
PROBE = "LONG_CONTEXT_PROBE"

# Put on PYTHONPATH for the benchmark's launches only: each rank of the recipe times every
# torch.distributed.all_to_all_single call (where DeepSpeed's Ulysses exchange ends: deepspeed.sequence.layer
# -> deepspeed.comm.all_to_all_single -> its TorchBackend -> torch.distributed) and writes them, with its
# peak RSS, to $LONG_CONTEXT_PROBE/rank<RANK>.json when it exits. The launcher itself is left alone.
SITECUSTOMIZE = """
import sys

if sys.argv and sys.argv[0].endswith("finetune_llm.py"):
    import atexit
    import functools
    import json
    import os
    import resource
    import time

    import torch.distributed

    calls = []
    exchange = torch.distributed.all_to_all_single

    @functools.wraps(exchange)
    def timed(*args, **kwargs):
        start, clock = time.time(), time.perf_counter()
        try:
            return exchange(*args, **kwargs)
        finally:
            calls.append((start, time.perf_counter() - clock))

    torch.distributed.all_to_all_single = timed

    def report():
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        path = os.path.join(os.environ["LONG_CONTEXT_PROBE"], "rank%s.json" % os.environ.get("RANK", "0"))
        with open(path, "w") as handle:
            json.dump({"peak_rss_mb": peak_mb, "all_to_all": calls}, handle)

    atexit.register(report)
"""


def build_long_model(out: Path) -> None:
    """The other sections' ~20M Llama, its positions extended to LONG (rotary: no weight depends on them)."""
    build_model_dir(out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = LONG
    (out / "config.json").write_text(json.dumps(config, indent=2))


def write_long_data(path: Path) -> None:
    """ROWS chats of plain words, each a short question and an answer of LONG words (longer than LONG
    tokens), so every row is cut to exactly `data.max_length` real tokens at either length."""
    from transformers import AutoTokenizer

    text = sentences(AutoTokenizer.from_pretrained(TOKENIZER_DIR))
    with path.open("w") as handle:
        for _ in range(ROWS):
            messages = [
                {"role": "user", "content": text(12, 0.0)},
                {"role": "assistant", "content": text(LONG, 0.0)},
            ]
            handle.write(json.dumps({"messages": messages}) + "\n")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def out_dir(name: str, length: int, work: Path) -> Path:
    return work / "out" / f"{name.replace(' ', '-').replace('=', '')}-{length}"


def command(name: str, length: int, work: Path) -> list[str]:
    config, processes, threads = CONTENDERS[name]
    return [str(ACCELERATE), "launch", "--config_file", str(ROOT / "accelerate_configs" / config),
            "--num_processes", str(processes), "--num_cpu_threads_per_process", str(threads),
            "--main_process_port", str(free_port()),
            str(ROOT / "recipes" / "finetune_llm.py"), "--config", str(BENCH / "ftkit.yaml"),
            f"model.path={work / 'model'}", f"data.train={work / 'data.jsonl'}",
            f"output_dir={out_dir(name, length, work)}", "model.method=full",
            "model.gradient_checkpointing=false", f"data.max_length={length}", f"train.max_steps={STEPS}",
            f"train.global_batch_size={GLOBAL_BATCH}", f"train.micro_batch_size={MICRO_BATCH}",
            f"train.learning_rate={LEARNING_RATE}", "train.log_every_steps=1",
            "train.save_every_steps=0"]  # fmt: skip


def launch(name: str, length: int, work: Path) -> tuple[float, list[dict]]:
    """One run to its end with the probe on: (wall seconds, each rank's probe record in rank order)."""
    probe = work / "probe"
    probe.mkdir(exist_ok=True)
    for old in probe.glob("rank*.json"):
        old.unlink()
    env = {**os.environ, "PYTHONPATH": str(work / "site"), PROBE: str(probe)}
    started = time.time()
    done = subprocess.run(command(name, length, work), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)  # fmt: skip
    wall = time.time() - started
    if done.returncode != 0:
        raise SystemExit(f"{name} at {length} failed:\n{done.stderr.decode()[-3000:]}")
    records = sorted(probe.glob("rank*.json"), key=lambda p: int(p.stem.removeprefix("rank")))
    if len(records) != CONTENDERS[name][1]:
        raise SystemExit(f"{name} at {length}: {len(records)} probe records for {CONTENDERS[name][1]} ranks")
    return wall, [json.loads(p.read_text()) for p in records]


def run_once(name: str, length: int, work: Path) -> dict:
    wall, ranks = launch(name, length, work)
    lines = [x for x in read_metrics(out_dir(name, length, work) / "metrics.jsonl") if "step_time_s" in x]
    measured = lines[WARMUP:]
    # The measured steps' span as rank 0 stamps it: from the end of the last warm-up step to the end of the
    # last step. An exchange call counts when it starts inside it (every rank's clock is the machine's).
    begin, end = lines[WARMUP - 1]["time"], lines[-1]["time"]
    inside = [[d for start, d in r["all_to_all"] if begin <= start <= end] for r in ranks]
    return {
        "length": length,
        "step_s": [x["step_time_s"] for x in measured],
        "tokens": [round(x["tokens_per_s"] * x["step_time_s"]) for x in measured],
        "loss": [x["loss"] for x in lines],
        "rank_peak_mb": [r["peak_rss_mb"] for r in ranks],
        "rank0_training_peak_mb": lines[-1]["peak_mem_mb"],
        "span_s": end - begin,
        "all_to_all_s": [sum(calls) for calls in inside],
        "all_to_all_calls": [len(calls) for calls in inside],
        "wall_s": wall,
    }


def summary(runs: list[dict]) -> dict:
    """Every measured step of every repeat pooled; memory as the median over repeats, rank by rank."""
    steps = [s for r in runs for s in r["step_s"]]
    processes = len(runs[0]["rank_peak_mb"])
    span = sum(r["span_s"] for r in runs)
    return {
        "tokens_per_s": sum(t for r in runs for t in r["tokens"]) / sum(steps),
        "step_s": statistics.median(steps),
        "fastest_s": min(steps),
        "rank_peak_mb": [statistics.median(r["rank_peak_mb"][k] for r in runs) for k in range(processes)],
        "rank0_training_peak_mb": statistics.median(r["rank0_training_peak_mb"] for r in runs),
        "all_to_all_share": [sum(r["all_to_all_s"][k] for r in runs) / span for k in range(processes)],
        "all_to_all_calls_per_step": runs[0]["all_to_all_calls"][0] / (STEPS - WARMUP),
        "loss": runs[0]["loss"],
        "wall_s": statistics.median(r["wall_s"] for r in runs),
    }


def table(results: dict[tuple[str, int], list[dict]]) -> str:
    lines = [
        "| contender | tokens a row | processes x threads | tokens/s | step time median (s) | "
        f"fastest step (s) | peak RSS a rank (MB) | over the same contender at {SHORT} tokens (MB) | "
        "rank 0 peak in training (MB) | all-to-all share of step time, each rank | "
        f"loss at step {STEPS} | whole run (s) |",
        "|---" * 12 + "|",
    ]
    for (name, length), runs in results.items():
        s = summary(runs)
        _, processes, threads = CONTENDERS[name]
        short = summary(results[name, SHORT])["rank_peak_mb"]
        growth = " / ".join(f"+{a - b:.0f}" for a, b in zip(s["rank_peak_mb"], short, strict=True))
        shares = " / ".join(f"{100 * x:.1f}%" for x in s["all_to_all_share"]) if processes > 1 else "—"
        peaks = " / ".join(f"{x:.0f}" for x in s["rank_peak_mb"])
        cells = [name, f"{length:,}", f"{processes} x {threads}", f"{s['tokens_per_s']:.0f}",
                 f"{s['step_s']:.2f}", f"{s['fastest_s']:.2f}", peaks, growth if length != SHORT else "—",
                 f"{s['rank0_training_peak_mb']:.0f}", shares, f"{s['loss'][-1]:.6f}",
                 f"{s['wall_s']:.1f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def losses(results: dict[tuple[str, int], list[dict]]) -> str:
    """Every step's loss of both contenders at each length, and the largest gap over every pair of runs."""
    lines = []
    for length in (LONG, SHORT):
        one, sp = (results[name, length] for name in CONTENDERS)
        gap = max(abs(a - b) for x in one for y in sp for a, b in zip(x["loss"], y["loss"], strict=True))
        steps = ", ".join(f"{a:.6f} / {b:.6f}" for a, b in zip(one[0]["loss"], sp[0]["loss"], strict=True))
        verdict = "agree to 1e-3" if gap <= 1e-3 else "**differ by more than 1e-3**"
        lines.append(
            f"- Losses at {length:,} tokens a row, steps 1-{STEPS} (one process / sp=2): {steps}. The "
            f"largest difference at any step of any pair of runs is {gap:.1e}: they {verdict}."
        )
    return "\n".join(lines)


def exchange(results: dict[tuple[str, int], list[dict]]) -> str:
    """The all-to-all figures behind the share column: calls a step and seconds inside them, each rank."""
    lines = []
    for length in (LONG, SHORT):
        runs = results["sp=2", length]
        inside = " and ".join(
            f"{sum(r['all_to_all_s'][k] for r in runs):.2f} s (rank {k})"
            for k in range(len(runs[0]["all_to_all_s"]))
        )
        lines.append(
            f"- All-to-all, sp=2 at {length:,}: {summary(runs)['all_to_all_calls_per_step']:.0f} calls a "
            f"step on each rank; inside them {inside} of the measured steps' "
            f"{sum(r['span_s'] for r in runs):.2f} s."
        )
    return "\n".join(lines)


def run_section(repeats: int, machine) -> str:
    """Both contenders at both lengths `repeats` times round-robin; returns the block it also writes."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "site").mkdir()
        (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        build_long_model(work / "model")
        write_long_data(work / "data.jsonl")
        results: dict[tuple[str, int], list[dict]] = {
            (name, length): [] for length in (LONG, SHORT) for name in CONTENDERS
        }
        for repeat in range(repeats):  # round-robin, so drift in machine speed hits every contender
            for name, length in results:
                results[name, length].append(run_once(name, length, work))
                print(f"[long-context {repeat + 1}/{repeats}] {name} {length}: {results[name, length][-1]}",
                      flush=True)  # fmt: skip
    measured = (STEPS - WARMUP) * repeats
    head = (
        f"Machine: {machine()}. {repeats} runs of each contender at each length; rates, step times and "
        f"all-to-all shares pool steps {WARMUP + 1}-{STEPS} of every run ({measured} steps a contender), "
        "peak RSS is the median over the runs, rank by rank (rank 0 / rank 1)."
    )
    block = "\n\n".join([head, table(results), losses(results) + "\n" + exchange(results)])
    write_results(BENCH / "RESULTS.md", block, (BEGIN, END))
    raw = {
        "machine": machine(),
        "runs": {f"{name} {length}": runs for (name, length), runs in results.items()},
        "summary": {f"{name} {length}": summary(runs) for (name, length), runs in results.items()},
    }
    (BENCH / "raw_long_context.json").write_text(json.dumps(raw, indent=1))
    return block


if __name__ == "__main__":
    run_from_command_line(__doc__, run_section, repeats=2)
