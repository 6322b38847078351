"""The learning-rate factor: linear warmup to the peak, then cosine, linear or constant down to the floor."""

import math

import pytest
import torch

from toolkit.config import TrainConfig
from toolkit.train.optim import build_scheduler, lr_factor


def train(**settings) -> TrainConfig:
    return TrainConfig(**{"max_steps": 12, "warmup_steps": 4, "min_lr_ratio": 0.1, **settings})


def test_warmup_climbs_in_equal_steps_to_the_peak():
    cfg = train()
    assert [lr_factor(s, cfg) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])


@pytest.mark.parametrize(
    ("schedule", "quarter"), [("cosine", 0.5 * (1 + math.cos(math.pi / 4))), ("linear", 0.75)]
)
def test_decay_reaches_the_floor_at_max_steps_and_stays_there(schedule, quarter):
    cfg = train(lr_scheduler=schedule)
    # 8 decay steps after warmup: step 6 is a quarter of the way, step 8 half, step 12 the end.
    assert lr_factor(6, cfg) == pytest.approx(0.1 + 0.9 * quarter)
    assert lr_factor(8, cfg) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(12, cfg) == pytest.approx(0.1)
    assert lr_factor(30, cfg) == pytest.approx(0.1)
    after_warmup = [lr_factor(s, cfg) for s in range(4, 13)]
    assert all(a > b for a, b in zip(after_warmup, after_warmup[1:]))


def test_constant_holds_the_peak_and_no_warmup_starts_there():
    assert [lr_factor(s, train(lr_scheduler="constant")) for s in (4, 8, 12, 30)] == [1.0] * 4
    assert lr_factor(0, train(warmup_steps=0)) == 1.0


def test_the_scheduler_applies_the_factor_once_per_step():
    cfg = train()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = build_scheduler(optimizer, cfg)
    seen = []
    for _ in range(13):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([2.0 * lr_factor(s, cfg) for s in range(13)])
