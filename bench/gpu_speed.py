"""The GPU check's speed parts (bench/gpu_check.py runs them): ftkit at its defaults against TRL's
SFTTrainer, and the defaults' compiled blocks and flex attention against the eager forward on SDPA."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
PY = sys.executable


def part_speed(kit) -> None:
    """ftkit at its defaults against TRL's SFTTrainer at its defaults and with Liger's kernels."""
    if kit.done("speed", "ftkit / TRL + Liger"):
        return
    seq, micro, steps = kit.seq(2048), 4, (4 if kit.smoke else 20)
    model = kit.model("llama-1b")
    keys = [f"data.max_length={seq}", f"train.micro_batch_size={micro}", f"train.global_batch_size={micro}"]
    ours = kit.ftkit("speed ftkit", model, *keys, f"train.max_steps={steps}")
    kit.record("speed", "ftkit", **speed_values(ours))
    liger = importlib.util.find_spec("liger_kernel") is not None
    for case, extra in (("TRL SFTTrainer", []), ("TRL SFTTrainer + Liger", ["liger"])):
        if extra and not liger:
            kit.record("speed", case, skipped="liger-kernel is not installed (pip install liger-kernel)")
            continue
        theirs = trl_run(kit, model, seq, micro, steps, *extra)
        kit.record("speed", case, **speed_values(theirs))
        if "error" not in ours and "error" not in theirs:
            ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
            kit.record("speed", f"ftkit / {case.replace(' SFTTrainer', '')}", tokens_per_s=ratio)


def trl_run(kit, model: Path, seq: int, micro: int, steps: int, *extra: str) -> dict:
    """bench/gpu_trl.py's result ({"error": ...} when it fails); `extra`: "liger" for Liger's kernels."""
    out = kit.work / "runs" / f"speed_trl{'_'.join(['', *extra])}.json"
    command = [PY, str(BENCH / "gpu_trl.py"), str(model), str(kit.data()), str(out), str(seq), str(micro)]
    command += [str(steps), *extra]
    done = subprocess.run(command, cwd=BENCH, capture_output=True, text=True, env=quiet_env())
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][-300:]}
    return json.loads(out.read_text())


def speed_values(run: dict) -> dict:
    keys = ("tokens_per_s", "mfu", "peak_mem_mb", "loss", "error")
    return {k: run[k] for k in keys if k in run}


# ---- compile: the defaults against the eager forward ----

COMPILE_CASES = {  # case: keys against gpu-check.yaml, whose compile and attention are auto (the defaults)
    "defaults: compiled blocks, flex attention": [],
    "eager forward, sdpa (the defaults before)": ["model.compile=false", "model.attn_implementation=sdpa"],
    "compiled blocks, sdpa": ["model.attn_implementation=sdpa"],
    "eager forward, flex attention": ["model.compile=false"],
}


def part_compile(kit) -> None:
    seq, steps = kit.seq(2048), (4 if kit.smoke else 20)
    keys = [f"data.max_length={seq}", "train.micro_batch_size=4", "train.global_batch_size=4"]
    model = kit.model("llama-1b")
    base = None
    for case, switch in COMPILE_CASES.items():
        if kit.done("compile", case):
            continue
        keys_of_case = [*keys, f"train.max_steps={steps}", *switch]
        run = kit.ftkit(f"compile {case}", model, *keys_of_case, logs="recompiles,graph_breaks")
        extra = {k: run[k] for k in ("first_step_s", "recompiles", "graph_breaks") if k in run}
        values = against_base(run, base) if base else speed_values(run)
        kit.record("compile", case, **values, **extra)
        base = base or (run if "error" not in run else None)


def against_base(run: dict, base: dict) -> dict:
    values = speed_values(run)
    if "error" in run or "error" in base:
        return values
    values["speed_vs_base"] = run["tokens_per_s"] / base["tokens_per_s"]
    values["memory_vs_base"] = run["peak_mem_mb"] / base["peak_mem_mb"]
    values["loss_vs_base"] = run["loss"] / base["loss"] - 1
    return values


def quiet_env() -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.pop("FTKIT_VERBOSE", None)
    return env
