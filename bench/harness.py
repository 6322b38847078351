"""What every bench section shares to run its contenders and report them: a timed process with its peak
memory, the min / median / max table, and the machine's line."""

import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
from common import ROOT

BENCH = Path(__file__).resolve().parent


def run_process(name: str, cmd: list[str], work: Path) -> tuple[float, float, float]:
    """Run `cmd` to its end with BENCH_STATS at work/stats.json: (launch time, wall seconds, peak RSS MB)."""
    stats_path = work / "stats.json"
    stats_path.unlink(missing_ok=True)
    env = {**os.environ, "BENCH_STATS": str(stats_path), "PYTHONPATH": str(BENCH)}
    launched = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.time() - launched
    if status != 0:
        raise SystemExit(f"{name} failed:\n{stderr.decode()[-3000:]}")
    return launched, wall, usage.ru_maxrss / 1024


def round_robin(section: str, cmds: dict, repeats: int, run_once) -> dict[str, list[dict]]:
    """Every contender `repeats` times, one after another each round, so drift in the machine's speed hits
    every contender alike; `run_once(name, cmd)` gives a run's figures."""
    results: dict[str, list[dict]] = {name: [] for name in cmds}
    for repeat in range(repeats):
        for name, cmd in cmds.items():
            results[name].append(run_once(name, cmd))
            print(f"[{section} {repeat + 1}/{repeats}] {name}: {results[name][-1]}", flush=True)
    return results


COLUMNS = [
    ("tokens_per_s", "real tokens/s", "{:.0f}"),
    ("step_s", "step time median (s)", "{:.2f}"),
    ("setup_s", "launch → start of step 1 (s)", "{:.1f}"),
    ("first_step_s", "launch → end of step 1 (s)", "{:.1f}"),
    ("rss_mb", "peak RSS (MB)", "{:.0f}"),
    ("loss", "final loss", "{:.3f}"),
    ("wall_s", "whole run (s)", "{:.1f}"),
]


def table(results: dict[str, list[dict]], columns=COLUMNS) -> str:
    lines = ["| contender | " + " | ".join(c[1] for c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, runs in results.items():
        cells = []
        for key, _, fmt in columns:
            values = sorted(r[key] for r in runs)
            cells.append(
                " / ".join(fmt.format(v) for v in (values[0], statistics.median(values), values[-1]))
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    cpu = next((x.split(":")[1].strip() for x in cpuinfo if x.startswith("model name")), "?")
    ram = int(next(x.split()[1] for x in meminfo if x.startswith("MemTotal"))) / 2**20
    load = os.getloadavg()
    return (
        f"{os.cpu_count()} cores ({cpu}), {ram:.0f} GiB RAM, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__} (CPU), "
        f"load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
    )


def run_from_command_line(doc: str, run_section, repeats: int) -> None:
    """A section's own command line: `--repeats` (default `repeats`), then the section's block printed."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=repeats)
    print(run_section(parser.parse_args().repeats, machine))
