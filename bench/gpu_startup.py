"""The GPU check's start-up and large-shape parts (bench/gpu_check.py runs them): how long a compiled run
takes to its first step, cold and from its own compile cache, with the evaluation before training; the
fused loss head alone; the 8B shape's speed under the defaults."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpu_speed import quiet_env, speed_values

BENCH = Path(__file__).resolve().parent
STARTS = {  # case: the compiler caches the launch finds
    "cold: empty compiler caches": "cold",
    "warm: empty compiler caches, the run's compile cache": "warm",
}
KEPT = ("first_step_s", "to_first_step_s", "compile_cache_hits", "compile_cache_misses", "recompiles")


def part_startup(kit) -> None:
    """The 1B shape at the defaults with an eval set (evaluated before training), launched twice into the
    same run folder, each time with empty inductor and Triton caches: the second start has only what the
    run kept (checkpoint/compile_cache.py). Then the loss head alone, eager against fused."""
    seq, steps = kit.seq(2048), (4 if kit.smoke else 20)
    keys = [f"data.max_length={seq}", "train.micro_batch_size=4", "train.global_batch_size=4"]
    keys += [f"train.max_steps={steps}", "data.eval_fraction=0.01", "train.overwrite=true"]
    model = kit.model("llama-1b")
    for case, name in STARTS.items():
        if kit.done("startup", case):
            continue
        caches = kit.work / "caches" / name
        env = {
            "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
            "TRITON_CACHE_DIR": str(caches / "triton"),
        }
        run = kit.ftkit("startup", model, *keys, logs="recompiles,graph_breaks", env=env)
        kit.record("startup", case, **speed_values(run), **{k: run[k] for k in KEPT if k in run})
    if kit.done("startup", "loss head alone: fused"):
        return
    tokens = 1024 if kit.smoke else 8192
    command = [sys.executable, str(BENCH / "fused_head.py"), "--tokens", str(tokens)]
    command += ["--vocab", "2048" if kit.smoke else "128256", "--hidden", "64" if kit.smoke else "2048"]
    done = subprocess.run(command, cwd=BENCH.parent, capture_output=True, text=True, env=quiet_env())
    if done.returncode != 0:
        kit.record("startup", "loss head alone", error=(done.stderr.strip().splitlines() or ["failed"])[-1])
        return
    for line in done.stdout.splitlines():
        result = json.loads(line)
        kit.record("startup", f"loss head alone: {result.pop('case')}", **result)


def part_large(kit) -> None:
    """The Llama-3.1-8B shape at the defaults, 2,048 tokens x 1 a step: tokens/s, MFU, peak memory."""
    case = "llama-8b LoRA r16, 2,048 x 1, defaults"
    if kit.done("large", case):
        return
    keys = [f"data.max_length={kit.seq(2048)}", "train.micro_batch_size=1", "train.global_batch_size=1"]
    keys += [f"train.max_steps={4 if kit.smoke else 12}"]
    run = kit.ftkit("large 8b", kit.model("llama-8b"), *keys, logs="recompiles,graph_breaks")
    kit.record("large", case, **speed_values(run), **{k: run[k] for k in KEPT if k in run})
    kit.drop_model("llama-8b")
