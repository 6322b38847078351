"""How long a compiled run takes to its first step, with the evaluation before training: cold, warm from
the run's own compile cache (inductor's cache empty, as on a new machine), warm from this machine's caches
too, and eager for reference; and whether the evaluation should share the compiled blocks (an eval-mode
graph compiled for it) or run them eagerly, as ftkit does, over the default schedule (before and after
training). The demo's SFT run (tiny Llama, packed rows), each case a fresh process, round-robin repeats.

    python bench/compile_startup.py [--repeats 3] [--steps 3]

Prints a table of medians and writes every run's figures to bench/raw_compile_startup.json."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import machine

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "finetune_llm.py"
RAW = ROOT / "bench" / "raw_compile_startup.json"
# The evaluation with the compiled blocks, for comparison only: ftkit runs them eagerly there.
EVAL_COMPILED = (
    "import contextlib, runpy, sys; import toolkit.train.evaluate as e; "
    "e.eager_blocks = contextlib.nullcontext; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)
CASES = {  # case: (model.compile, the inductor cache it finds, the run's compile cache kept, eval compiled)
    "eager (compile off)": (False, "empty", False, False),
    "compiled, cold": (True, "empty", False, False),
    "compiled, warm from the run's compile cache": (True, "empty", True, False),
    "compiled, warm from this machine's caches too": (True, "kept", True, False),
    "compiled, cold, evaluation compiled too": (True, "empty", False, True),
}


def run_case(work: Path, case: str, steps: int) -> dict:
    compiled, inductor, keep_run, eval_compiled = CASES[case]
    out = work / "run"
    if not keep_run:
        shutil.rmtree(out, ignore_errors=True)
    cache = work / "inductor"
    if inductor == "empty":
        shutil.rmtree(cache, ignore_errors=True)
    keys = ["--config", str(ROOT / "toolkit/assets/demo.yaml"), f"output_dir={out}", "train.overwrite=true"]
    keys += [f"model.compile={str(compiled).lower()}", "data.packing=true", f"train.max_steps={steps}"]
    keys += ["eval.exact_match_samples=8", "train.log_every_steps=1"]
    head = [sys.executable, "-c", EVAL_COMPILED] if eval_compiled else [sys.executable]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), XDG_CACHE_HOME=str(work / "home"))
    env |= {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    started = time.time()
    done = subprocess.run([*head, str(RECIPE), *keys], cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.time() - started
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1][-300:]}
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first = next(line for line in lines if "step_time_s" in line)
    return {"to_first_step_s": first["time"] - started, "first_step_s": first["step_time_s"], "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {case: [] for case in CASES}
    with tempfile.TemporaryDirectory(prefix="ftkit-compile-startup-") as work:
        for _ in range(args.repeats):
            for case in CASES:  # in order: each warm case follows the start it is warm from
                runs[case].append(run_case(Path(work), case, args.steps))
                print(case, runs[case][-1], flush=True)
    RAW.write_text(json.dumps({"machine": machine(), "steps": args.steps, "runs": runs}, indent=1) + "\n")
    print("\n| case | to first step (s) | first step (s) | whole run (s) |\n|---|---|---|---|")
    for case, results in runs.items():
        good = [r for r in results if "error" not in r]
        if not good:
            print(f"| {case} | {results[0]['error']} | | |")
            continue
        med = {
            k: statistics.median(r[k] for r in good) for k in ("to_first_step_s", "first_step_s", "wall_s")
        }
        print(f"| {case} | {med['to_first_step_s']:.1f} | {med['first_step_s']:.1f} | {med['wall_s']:.1f} |")


if __name__ == "__main__":
    main()
