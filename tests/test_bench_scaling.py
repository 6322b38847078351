"""`ftkit bench-scaling`: the arithmetic on made-up metrics, and one real 1-vs-2-process DDP run."""

import json
import subprocess
import sys

import pytest
from helpers import QUICK, REPO

from toolkit.commands.bench_scaling import parse_counts, scaling_points, timed_throughput
from toolkit.errors import UserError


def test_counts_are_sorted_distinct_and_positive():
    assert parse_counts("4,1,2,2") == [1, 2, 4]
    for bad in ("", "0,2", "one,two"):
        with pytest.raises(UserError, match="--nprocs"):
            parse_counts(bad)


def test_efficiency_is_speedup_over_added_devices():
    points = scaling_points({1: (1000.0, 1.0, 5), 2: (1800.0, 0.55, 5), 4: (3000.0, 0.33, 5)})
    assert [p.speedup for p in points] == pytest.approx([1.0, 1.8, 3.0])
    assert [p.efficiency for p in points] == pytest.approx([1.0, 0.9, 0.75])
    assert [p.tokens_per_s_per_device for p in points] == pytest.approx([1000, 900, 750])
    # Without a 1-process run, the smallest count is the reference.
    assert [p.efficiency for p in scaling_points({2: (1800.0, 1, 5), 4: (3000.0, 1, 5)})] == pytest.approx(
        [1.0, 3000 / 1800 / 2]
    )


def test_timed_throughput_leaves_out_warm_up_and_weighs_steps_by_time(tmp_path):
    lines = [
        {"step": 1, "tokens_per_s": 10.0, "step_time_s": 5.0},  # warm-up: left out
        {"step": 2, "tokens_per_s": 100.0, "step_time_s": 1.0},
        {"step": 2, "eval_loss": 1.0},
        {"step": 3, "tokens_per_s": 50.0, "step_time_s": 2.0},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert timed_throughput(path, warmup_steps=1) == (pytest.approx(200 / 3), 2.0, 2)
    with pytest.raises(UserError, match="no training step logged after step 3"):
        timed_throughput(path, warmup_steps=3)


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
