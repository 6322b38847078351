"""Data preparation at scale: synthetic 5-turn chat files of 20,000 and 100,000 examples (1,000,000 with
--million), each run to its first optimizer step at max_length 1024 by ftkit (data.num_proc 1 and 2) and by
TRL SFTTrainer's defaults, from a cold cache. Measures wall time from launch to the end of step 1 and peak
memory, and writes the table between the data markers of bench/RESULTS.md.

    python bench/data_prep.py [--million] [--sizes 20000 100000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
from common import ROOT, TOKENIZER_DIR, write_results
from harness import machine

from toolkit.train.metrics import read_metrics

BENCH = Path(__file__).resolve().parent
PY = sys.executable
MAX_LENGTH = 1024
TURNS = 5
BEGIN, END = "<!-- make bench data: begin -->", "<!-- make bench data: end -->"


def write_chats(path: Path, count: int, seed: int = 0) -> None:
    """`count` conversations of a system prompt and TURNS user/assistant exchanges of random words (~2.6 KB
    and ~500 tokens each), written a block at a time."""
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(TOKENIZER_DIR).get_vocab()
    words = np.array(sorted({t.lstrip("Ġ▁") for t in vocab if t.lstrip("Ġ▁").isalpha() and len(t) > 3}))
    rng = np.random.default_rng(seed)
    with path.open("w") as handle:
        for start in range(0, count, 1000):
            lines = []
            for _ in range(min(1000, count - start)):
                sizes = rng.integers(5, 70, 2 * TURNS)
                picked = iter(" ".join(words[rng.integers(0, len(words), n)]) for n in sizes)
                messages = [{"role": "system", "content": "You are a helpful assistant."}]
                for _ in range(TURNS):
                    messages += [
                        {"role": "user", "content": next(picked)},
                        {"role": "assistant", "content": next(picked)},
                    ]
                lines.append(json.dumps({"messages": messages}))
            handle.write("\n".join(lines) + "\n")


def commands(work: Path, data: Path) -> dict[str, list[str]]:
    model = str(TOKENIZER_DIR)  # the embedded tiny model: the step is cheap, the data preparation is not
    ftkit = [PY, str(ROOT / "recipes" / "finetune_llm.py"), "--config", str(BENCH / "ftkit.yaml"),
             f"model.path={model}", f"data.train={data}", f"output_dir={work / 'out'}", "train.max_steps=1",
             f"data.max_length={MAX_LENGTH}"]  # fmt: skip
    trl = [
        PY,
        str(BENCH / "hf_trainers.py"),
        "trl",
        model,
        str(data),
        str(work / "trl"),
        str(MAX_LENGTH),
        "1",
    ]
    return {"ftkit num_proc=1": [*ftkit, "data.num_proc=1"], "ftkit num_proc=2": [*ftkit, "data.num_proc=2"],
            "TRL SFTTrainer": trl}  # fmt: skip


def measure(name: str, cmd: list[str], work: Path) -> dict:
    """Launch → end of step 1, and peak memory: `ru_maxrss` (the largest single process, as /usr/bin/time
    reports it) and the largest sum over the process tree sampled every 0.2 s (worker processes included;
    pages they share with their parent are counted twice)."""
    cache = Path(tempfile.mkdtemp(dir=work, prefix="hf-cache-"))  # cold: nothing encoded before
    stats = work / "stats.json"
    env = {
        **os.environ,
        "HF_DATASETS_CACHE": str(cache),
        "BENCH_STATS": str(stats),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{BENCH}",
    }
    log = work / "stderr.txt"
    launched = time.time()
    with log.open("wb") as stderr:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        watched, tree_peak = psutil.Process(proc.pid), 0
        while True:
            tree_peak = max(tree_peak, _tree_rss(watched))
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(0.2)
    wall = time.time() - launched
    if status != 0:
        raise SystemExit(f"{name} failed:\n{log.read_text()[-3000:]}")
    if name.startswith("ftkit"):
        first_step_end = read_metrics(work / "out" / "metrics.jsonl")[0]["time"]
    else:
        first_step_end = json.loads(stats.read_text())["step_end"][0]
    return {
        "first_step_s": first_step_end - launched,
        "maxrss_mb": usage.ru_maxrss / 1024,
        "tree_peak_mb": tree_peak / 2**20,
        "wall_s": wall,
    }


def _tree_rss(process: psutil.Process) -> int:
    total = 0
    for p in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # ended between listing and reading
            total += p.memory_info().rss
    return total


COLUMNS = [
    ("first_step_s", "launch → end of step 1 (s)", "{:.1f}"),
    ("maxrss_mb", "peak RSS, largest process (MB)", "{:.0f}"),
    ("tree_peak_mb", "peak RSS, process tree (MB)", "{:.0f}"),
]


def table(results: dict[int, dict[str, dict]]) -> str:
    head = "| examples | contender | " + " | ".join(c[1] for c in COLUMNS) + " |"
    lines = [head, "|---" * (len(COLUMNS) + 2) + "|"]
    for count, runs in results.items():
        for name, run in runs.items():
            cells = " | ".join(fmt.format(run[key]) for key, _, fmt in COLUMNS)
            lines.append(f"| {count:,} | {name} | {cells} |")
    return "\n".join(lines)


def verdicts(results: dict[int, dict[str, dict]]) -> str:
    """The issue's targets, judged on these single runs."""
    lines = []
    sizes = sorted(results)
    best = {n: min(r["first_step_s"] for k, r in results[n].items() if k.startswith("ftkit")) for n in sizes}
    for n in sizes:
        runs = results[n]
        speedup = runs["ftkit num_proc=1"]["first_step_s"] / runs["ftkit num_proc=2"]["first_step_s"]
        line = f"- {n:,} examples: num_proc 1 → 2 speed-up {speedup:.2f}x (launch → end of step 1)"
        if "TRL SFTTrainer" in runs:
            ratio = best[n] / runs["TRL SFTTrainer"]["first_step_s"]
            line += f"; ftkit's best / TRL = {ratio:.2f}"
            if n == 100000:
                line += f" (target ≤ 0.4): **{'met' if ratio <= 0.4 else 'not met'}**"
        lines.append(line)
    if 20000 in results and 100000 in results:
        small = results[20000]["ftkit num_proc=1"]["maxrss_mb"]
        large = results[100000]["ftkit num_proc=1"]["maxrss_mb"]
        lines.append(
            f"- peak RSS (num_proc=1, largest process), 100,000 over 20,000 examples: {large - small:+.0f} MB"
            f" (target ≤ +512 MB): **{'met' if large - small <= 512 else 'not met'}**"
        )
    if 1000000 in results:
        ftkit = [r for k, r in results[1000000].items() if k.startswith("ftkit")]
        peak = max(r["maxrss_mb"] for r in ftkit)
        tree = max(r["tree_peak_mb"] for r in ftkit)
        lines.append(
            f"- 1,000,000 examples: ftkit peak RSS {peak:.0f} MB largest process, {tree:.0f} MB process tree "
            f"(target ≤ 4096 MB): **{'met' if max(peak, tree) <= 4096 else 'not met'}**"
        )
    return "\n".join(lines)


def earlier_runs(sizes: list[int]) -> tuple[dict[int, dict[str, dict]], dict[int, str]]:
    """(runs, machine lines) of the sizes not run now, from bench/raw_data_prep.json, so that a run of
    one size (e.g. `--sizes 1000000`) adds its rows to the table instead of replacing it."""
    raw = BENCH / "raw_data_prep.json"
    if not raw.is_file():
        return {}, {}
    earlier = json.loads(raw.read_text())
    machines = earlier.get("machines") or {n: earlier["machine"] for n in earlier["runs"]}
    keep = [n for n in earlier["runs"] if int(n) not in sizes]
    return {int(n): earlier["runs"][n] for n in keep}, {int(n): machines[n] for n in keep}


def run_section(sizes: list[int], machine: str) -> str:
    """Every contender once per size (fresh cache each run); returns the markdown block it also writes."""
    results, machines = earlier_runs(sizes)
    machines.update({count: machine for count in sizes})
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for count in sizes:
            data = work / f"chats-{count}.jsonl"
            write_chats(data, count)
            results[count] = {}
            for name, cmd in commands(work, data).items():
                if count > 100000 and name.startswith("TRL"):
                    continue  # TRL holds a million tokenized rows in memory; the target is ftkit's own
                results[count][name] = measure(name, cmd, work)
                print(f"[data {count:,}] {name}: {results[count][name]}", flush=True)
            data.unlink()
    results = dict(sorted(results.items()))
    heads = [f"Machine ({', '.join(f'{n:,}' for n in sorted(machines) if machines[n] == line)} examples): "
             f"{line}." for line in dict.fromkeys(machines[n] for n in sorted(machines))]  # fmt: skip
    heads.append("One run of each, each from an empty datasets cache.")
    block = "\n\n".join(["\n".join(heads), table(results), verdicts(results)])
    write_results(BENCH / "RESULTS.md", block, (BEGIN, END))
    raw = {"machines": machines, "runs": results}
    (BENCH / "raw_data_prep.json").write_text(json.dumps(raw, indent=1))
    return block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[20000, 100000])
    parser.add_argument("--million", action="store_true", help="also 1,000,000 examples (ftkit only)")
    args = parser.parse_args()

    print(run_section(args.sizes + ([1000000] if args.million else []), machine()))


if __name__ == "__main__":
    main()
