"""`ftkit bench-scaling`: the arithmetic on made-up metrics (the real runs are in tests/e2e)."""

import json

import pytest

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
