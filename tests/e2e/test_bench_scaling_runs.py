"""`ftkit bench-scaling` for real: 1 and 2 DDP processes, and a failed run reported in one line.

Launches: real, through the `ftkit bench-scaling` command line (the command is what is tested).
"""

import json
import subprocess
import sys

import pytest
from helpers import QUICK, REPO

from toolkit.commands.bench_scaling import timed_throughput


def run_cli(tmp_path, *overrides):
    command = [sys.executable, "-m", "toolkit.commands.cli", "bench-scaling", "--config_file"]
    command += [str(REPO / "accelerate_configs" / "ddp.yaml"), "--nprocs", "1,2", "--out", str(tmp_path)]
    return subprocess.run(
        [*command, "--json", "--", *QUICK, "train.max_steps=6", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.multiproc
def test_ddp_one_and_two_processes(tmp_path):
    result = run_cli(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    points = json.loads(result.stdout)
    assert [p["processes"] for p in points] == [1, 2]
    assert points[0]["speedup"] == 1.0 and points[1]["efficiency"] == pytest.approx(points[1]["speedup"] / 2)
    assert json.loads((tmp_path / "scaling.json").read_text()) == points
    for n in (1, 2):
        assert f"| world {n} |" in (tmp_path / f"nprocs-{n}.log").read_text()
        # Same global batch: the same real tokens every step, whatever the process count.
        assert timed_throughput(tmp_path / f"nprocs-{n}" / "metrics.jsonl", 2)[2] == 4
    tokens = [
        [round(r["tokens_per_s"] * r["step_time_s"]) for r in map(json.loads, lines) if "tokens_per_s" in r]
        for lines in ((tmp_path / f"nprocs-{n}" / "metrics.jsonl").read_text().splitlines() for n in (1, 2))
    ]
    assert tokens[0] == tokens[1]


@pytest.mark.multiproc
def test_a_failed_run_is_one_line_naming_its_log(tmp_path):
    result = run_cli(tmp_path, "train.global_batch_size=7")
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("ftkit bench-scaling: error: the run with 1 process(es) failed (exit 1)")
    assert "nprocs-1.log" in error and "global_batch_size" in error
