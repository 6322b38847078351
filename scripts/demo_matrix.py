"""Run a demo under several CPU kernel sets and seeds and print its held-out gain in each, so a demo's
figure stays a property of its recipe, not of one machine's rounding (docs/grpo.md#the-demo-on-any-cpu).

    python scripts/demo_matrix.py demo-grpo [--seeds 42 1] [--capabilities default avx2 avx512] \\
        [--min-gain 10] [--args "grpo.beta=0.04"]

Each cell runs `make TARGET ARGS="seed=S output_dir=runs/matrix/TARGET-CAP-sS ..."` with
ATEN_CPU_CAPABILITY=CAP and reads the run's own `result:` line (held-out A% -> B%; demo-agent's is its
measure's, with the calculator on the 200 held-out sums). A stage a demo trains first when runs/ lacks it
(demo-distill's teacher, demo-agent's two SFT stages) is trained once, by the first cell, under its kernel
set, and shared by the cells after it. torch does not check the variable against the CPU (asked for avx512
where there is none, its kernels die of an illegal instruction), so a capability this CPU lacks is probed
first and its cells are reported as not run. Exit 1 when any cell run gains less than --min-gain points, or
when none could run.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv" / "bin" / "python"
RESULT = re.compile(r"^result:.*?([\d.]+)% -> ([\d.]+)%", re.MULTILINE)


def ran_as(capability: str) -> str | None:
    """The kernel set torch runs when asked for `capability`, or None when this CPU cannot run it."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    code = "import torch; torch.randn(4096).softmax(0).sum(); print(torch.backends.cpu.get_cpu_capability())"
    probe = subprocess.run([str(PYTHON), "-c", code], env=env, capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


def run_cell(target: str, capability: str, seed: int, extra: str, logs: Path) -> tuple[float, float] | None:
    """(start %, result %) of one run, or None when it printed no result line (its log says why)."""
    out = f"runs/matrix/{target}-{capability}-s{seed}"
    args = f"seed={seed} output_dir={out} {extra}".strip()
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    log = logs / f"{target}-{capability}-s{seed}.log"
    with log.open("w") as sink:
        subprocess.run(["make", target, f"ARGS={args}"], cwd=REPO, env=env, stdout=sink, stderr=sink)
    found = RESULT.findall(log.read_text())
    return (float(found[-1][0]), float(found[-1][1])) if found else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="a make target that ends with a result line (demo-grpo, ...)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1])
    parser.add_argument("--capabilities", nargs="+", default=["default", "avx2", "avx512"])
    parser.add_argument("--min-gain", type=float, default=10.0, help="points each cell must gain")
    parser.add_argument("--args", default="", help="more key=value overrides for every cell")
    args = parser.parse_args(argv)
    logs = REPO / "runs" / "matrix" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"| {args.target} | kernels run | seed | start | result | gain | time |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    gains = []
    for capability in args.capabilities:
        kernels = ran_as(capability)
        if kernels is None:
            print(f"| {capability} | not run: this CPU lacks it | {' '.join(map(str, args.seeds))} | | | | |")
            continue
        for seed in args.seeds:
            started = time.monotonic()
            cell = run_cell(args.target, capability, seed, args.args, logs)
            took = f"{(time.monotonic() - started) / 60:.1f} min"
            if cell is None:
                gains.append(float("-inf"))
                print(f"| {capability} | {kernels} | {seed} | no result line (see {logs}) | | | |")
                continue
            gains.append(cell[1] - cell[0])
            row = f"{cell[0]:.1f}% | {cell[1]:.1f}% | {gains[-1]:+.1f} | {took}"
            print(f"| {capability} | {kernels} | {seed} | {row} |", flush=True)
    if not gains:
        print("no cell could run on this CPU")
        return 1
    print(f"gain: min {min(gains):+.1f}, max {max(gains):+.1f} points over {len(gains)} runs")
    return 0 if min(gains) >= args.min_gain else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
