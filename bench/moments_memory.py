"""Reading optimizer moments across layouts: how much memory a process needs to read every parameter's Adam
moments out of a DeepSpeed ZeRO checkpoint through `toolkit.checkpoint.moments.read_zero`, one parameter at a
time (what a resume on another layout does: take one, keep this rank's part, drop the rest), against keeping
all of them. Builds a ZeRO-3 checkpoint (and a ZeRO-2 one with `--stages 3 2`, where memory allows) of a
random-init Qwen2.5-0.5B-shaped model once (2 gloo processes under `accelerate launch`, one AdamW step,
`accelerator.save_state`), cached under runs/bench-moments/ so reruns skip the build; then reads it in fresh
processes, its files dropped from the page cache first, sampling the reader's anonymous memory (RssAnon).
Writes its block between the moments markers of bench/RESULTS.md and every figure to
bench/raw_moments_memory.json (also run by `make bench`).

    python bench/moments_memory.py [--repeats 3] [--stages 3 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import write_results
from harness import machine

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
ACCELERATE = Path(sys.executable).parent / "accelerate"
CACHE = ROOT / "runs" / "bench-moments"
BEGIN, END = "<!-- make bench moments: begin -->", "<!-- make bench moments: end -->"
PROCESSES = 2
TOKENS = 64  # one random row a process: the step only has to leave Adam's state behind
# Qwen2.5-0.5B's shape (494M parameters, the embedding tied to the head), random weights.
SHAPE = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)
# Bytes a parameter costs a build process, fp32 throughout: ZeRO-3 keeps half of the weights, their fp32
# master copy, the gradients and Adam's two moments (20 / 2), plus the interpreter, the gathered embedding
# and its full gradient (16.2 measured); ZeRO-2 the whole weights besides half of the rest (estimated).
BUILD_BYTES = {3: 17, 2: 20}
# ZeRO-3 steps its optimizer one flat group at a time: groups of 100M elements bound the step's temporaries
# (DeepSpeed's default, 1e9, leaves this model one group a rank) and give the checkpoint several groups a
# rank, as a larger model's has, so parameters are cut across groups too.
SUB_GROUP = 100_000_000
MODES = ("one at a time", "all at once")
SAMPLE_S = 0.002


def estimate_parameters() -> int:
    """SHAPE's parameter count (for the memory check before a build)."""
    h, m, layers, v = (
        SHAPE[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
    )
    kv = h // SHAPE["num_attention_heads"] * SHAPE["num_key_value_heads"]
    attention = h * h + h + 2 * (h * kv + kv) + h * h
    return v * h + layers * (attention + 3 * h * m + 2 * h) + h


def available_bytes() -> int:
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    return int(next(x.split()[1] for x in meminfo if x.startswith("MemAvailable"))) * 1024


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def build(stage: int) -> dict:
    """The stage's checkpoint, built once: its build record (written last: a half-built folder is rebuilt)."""
    out = CACHE / f"zero{stage}"
    record = out / "build.json"
    if record.is_file():
        return json.loads(record.read_text())
    out.mkdir(parents=True, exist_ok=True)
    need, free = PROCESSES * BUILD_BYTES[stage] * estimate_parameters(), available_bytes()
    if need > free - 4 * 2**30:  # room left for whatever else runs here
        raise SystemExit(
            f"ZeRO-{stage} build needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
        )
    cmd = [str(ACCELERATE), "launch", "--config_file", str(ROOT / "accelerate_configs" / f"zero{stage}.yaml"),
           "--num_processes", str(PROCESSES), "--main_process_port", str(free_port()),
           __file__, "build", str(out)]  # fmt: skip
    started = time.time()
    with (out / "launch.log").open("w") as log:
        done = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"ZeRO-{stage} build failed: see {out / 'launch.log'}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(PROCESSES)]
    tag = out / "checkpoint" / "pytorch_model"
    files = {path.name: path.stat().st_size for path in sorted(tag.iterdir())}
    built = {"stage": stage, "wall_s": time.time() - started, "ranks": ranks, "files": files,
             "bytes": sum(files.values())}  # fmt: skip
    record.write_text(json.dumps(built, indent=1))
    return built


def build_worker(out: Path) -> None:
    """One rank of the build: the model sharded as it is built (ZeRO-3), one AdamW step, save_state."""
    import resource

    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs
    from transformers import AutoConfig, AutoModelForCausalLM

    plugin = DeepSpeedPlugin(gradient_accumulation_steps=1, gradient_clipping=1.0)
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
    plugin.deepspeed_config["train_batch_size"] = PROCESSES
    plugin.deepspeed_config["zero_optimization"]["sub_group_size"] = SUB_GROUP
    # gloo, as ftkit's CPU launches ask: without it accelerate gives each process a world of its own.
    group = InitProcessGroupKwargs(backend="gloo")
    accelerator = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[group])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **SHAPE))
    # One parameter at a time: the multi-tensor step's temporaries would add a partition's size again.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, foreach=False)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(accelerator.process_index)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, TOKENS), generator=generator)
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    accelerator.save_state(str(out / "checkpoint"))
    accelerator.wait_for_everyone()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps({"peak_rss_mb": peak_mb}))


def memory_kib() -> dict[str, int]:
    """This process's anonymous and file-backed resident memory (/proc/self/status), in KiB."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return {k: int(x.split()[1]) for x in lines for k in ("RssAnon", "RssFile") if x.startswith(k + ":")}


class Sampler:
    """The largest RssAnon and RssFile seen every SAMPLE_S since the last `take` (torch's copies release the
    GIL, so the thread sees the peaks inside a cut, not only between cuts)."""

    def __init__(self):
        self.peak = memory_kib()
        self.lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            now = memory_kib()
            with self.lock:
                self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}
            time.sleep(SAMPLE_S)

    def take(self) -> dict[str, int]:
        now = memory_kib()
        with self.lock:
            peak, self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}, now
        return peak


def drop_page_cache(directory: Path) -> None:
    """Evict the checkpoint's clean pages (this folder's only), so every read starts from the disk."""
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_worker(tag: Path, mode: str) -> None:
    """Read every parameter's moments in a fresh process and print the figures as one JSON line."""
    import torch

    from toolkit.checkpoint import moments

    torch.set_num_threads(1)
    sampler = Sampler()
    base = sampler.take()
    started = time.perf_counter()
    found = moments.read_zero(tag)
    index = sampler.take()
    kept, params = {}, []
    for name in found:
        state = found[name]
        touched = sum(float(state[f].sum()) for f in moments.ZERO_STATE_FIELDS)
        size = sum(state[f].numel() * state[f].element_size() for f in moments.ZERO_STATE_FIELDS)
        if mode == "all at once":
            kept[name] = state
        del state
        peak = sampler.take()
        params.append(
            {
                "name": name,
                "bytes": size,
                "anon_kib": peak["RssAnon"],
                "file_kib": peak["RssFile"],
                "finite": math.isfinite(touched),
            }  # fmt: skip
        )
    wall = time.perf_counter() - started
    end = memory_kib()
    largest = max(params, key=lambda p: p["bytes"])
    print(json.dumps({
        "mode": mode, "wall_s": wall, "params": len(params),
        "moments_bytes": sum(p["bytes"] for p in params), "largest": largest["name"],
        "largest_bytes": largest["bytes"], "base_anon_kib": base["RssAnon"],
        "index_anon_kib": index["RssAnon"] - base["RssAnon"],
        "peak_anon_kib": max(p["anon_kib"] for p in params) - base["RssAnon"],
        "peak_at": max(params, key=lambda p: p["anon_kib"])["name"],
        "largest_peak_anon_kib": largest["anon_kib"] - base["RssAnon"],
        "end_anon_kib": end["RssAnon"] - base["RssAnon"],
        "peak_file_kib": max(p["file_kib"] for p in params) - base["RssFile"],
        "all_finite": all(p["finite"] for p in params),
    }))  # fmt: skip


def read(stage: int, mode: str) -> dict:
    tag = CACHE / f"zero{stage}" / "checkpoint" / "pytorch_model"
    drop_page_cache(tag)
    done = subprocess.run([sys.executable, __file__, "read", str(tag), mode], cwd=ROOT, capture_output=True,
                          text=True)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"ZeRO-{stage} read ({mode}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def gb(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.2f}"


def table(results: dict[int, dict[str, list[dict]]]) -> str:
    lines = [
        "| checkpoint | reading | wall (s) | after `read_zero`, the index (MB) | peak RssAnon over the "
        "baseline (GB) | ... at the largest parameter (GB) | left at the end (GB) | peak RssFile over the "
        "baseline: page cache mapped (GB) |",
        "|---" * 8 + "|",
    ]
    for stage, by_mode in results.items():
        for mode, runs in by_mode.items():
            cells = [f"ZeRO-{stage}", mode, f"{statistics.median(r['wall_s'] for r in runs):.1f}",
                     f"{statistics.median(r['index_anon_kib'] for r in runs) / 1e3:.0f}",
                     gb(max(r["peak_anon_kib"] for r in runs) * 1024),
                     gb(max(r["largest_peak_anon_kib"] for r in runs) * 1024),
                     gb(max(r["end_anon_kib"] for r in runs) * 1024),
                     gb(max(r["peak_file_kib"] for r in runs) * 1024)]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_section(repeats: int, stages: list[int], machine) -> str:
    """Build what is missing, read every stage's checkpoint both ways `repeats` times; returns the block it
    also writes."""
    builds = {stage: build(stage) for stage in stages}
    results: dict[int, dict[str, list[dict]]] = {s: {m: [] for m in MODES} for s in stages}
    for repeat in range(repeats):
        for stage in stages:
            for mode in MODES:
                results[stage][mode].append(read(stage, mode))
                print(f"[moments {repeat + 1}/{repeats}] ZeRO-{stage} {mode}: {results[stage][mode][-1]}")
    first = results[stages[0]][MODES[0]][0]
    head = (
        f"Machine: {machine()}. {repeats} runs of each reading, each a fresh process with the checkpoint's "
        f"pages dropped from the page cache first; wall time is the median, memory the largest over the runs."
    )
    facts = [
        f"- Model: Qwen2.5-0.5B's shape, random weights, fp32: {first['params']} parameter tensors, "
        f"{first['moments_bytes'] // 8:,} parameters. Moments (exp_avg + exp_avg_sq) of all of them: "
        f"{gb(first['moments_bytes'])} GB; of the largest, `{first['largest']}`: "
        f"{gb(first['largest_bytes'])} GB."
    ]
    for stage, by_mode in results.items():
        each, kept = (max(r["peak_anon_kib"] * 1024 for r in by_mode[mode]) for mode in MODES)
        facts.append(
            f"- ZeRO-{stage}: one parameter at a time peaks at {gb(each)} GB over the baseline, "
            f"{each / first['largest_bytes']:.2f}x the largest parameter's moments and "
            f"{each / first['moments_bytes']:.2f}x all of them; keeping them all, {gb(kept)} GB."
        )
    for stage, built in builds.items():
        ranks = " / ".join(f"{r['peak_rss_mb'] / 1e3:.1f}" for r in built["ranks"])
        facts.append(
            f"- ZeRO-{stage} checkpoint (`pytorch_model/`, {len(built['files'])} files): "
            f"{gb(built['bytes'])} GB on disk; built in {built['wall_s']:.0f} s, peak RSS a rank {ranks} GB."
        )
    block = "\n\n".join([head, table(results), "\n".join(facts)])
    write_results(BENCH / "RESULTS.md", block, (BEGIN, END))
    raw = {"machine": machine(), "builds": builds, "runs": {f"zero{s}": r for s, r in results.items()}}
    (BENCH / "raw_moments_memory.json").write_text(json.dumps(raw, indent=1))
    return block


def main() -> None:
    if sys.argv[1:2] == ["build"]:
        return build_worker(Path(sys.argv[2]))
    if sys.argv[1:2] == ["read"]:
        return read_worker(Path(sys.argv[2]), sys.argv[3])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stages", type=int, nargs="+", choices=sorted(BUILD_BYTES), default=[3])
    args = parser.parse_args()
    print(run_section(args.repeats, args.stages, machine))


if __name__ == "__main__":
    main()
