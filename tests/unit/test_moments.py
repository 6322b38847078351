"""Optimizer moments cut back into parameters from ZeRO's flat partitions (tests/e2e/test_cross_backend.py
resumes real DeepSpeed checkpoints on other layouts with them)."""

import math

import pytest
import torch

from toolkit.checkpoint import moments, resume
from toolkit.errors import UserError

SHAPES = {"a": (3, 5), "b": (7,), "c": (2, 2)}


def zero3_ranks(world: int, full: dict[str, torch.Tensor]) -> list[dict]:
    """What ZeRO-3 saves for `full` moments: each parameter cut into `world` equal pieces (the last padded
    with zeros), rank r's pieces end to end in one flat group, Adam's state beside its fp32 copy."""
    flats = [[] for _ in range(world)]
    for tensor in full.values():
        piece = math.ceil(tensor.numel() / world)
        padded = torch.cat([tensor.flatten(), torch.zeros(piece * world - tensor.numel())])
        for rank in range(world):
            flats[rank].append(padded[rank * piece : (rank + 1) * piece])
    ranks = []
    for pieces in flats:
        flat = torch.cat(pieces)
        state = {"step": torch.tensor(3.0), "exp_avg": flat, "exp_avg_sq": flat * 2}
        ranks.append({"fp32_flat_groups": [flat], moments.ZERO_OPTIM: {"state": {0: state}}})
    return ranks


def test_zero3_pieces_are_put_back_whole_and_only_when_asked():
    full = {name: torch.randn(shape) for name, shape in SHAPES.items()}
    lazy = moments._cut_zero3(zero3_ranks(2, full), SHAPES)
    assert list(lazy) == list(SHAPES) and "b" in lazy and "z" not in lazy
    for name, tensor in full.items():
        got = lazy[name]
        assert torch.equal(got["exp_avg"], tensor) and torch.equal(got["exp_avg_sq"], tensor * 2), name
        assert got["step"].item() == 3.0


def test_span_reads_across_partition_borders():
    parts = [torch.arange(0, 4), torch.arange(4, 6), torch.arange(6, 10)]
    assert torch.cat(moments._span(parts, 3, 5)).tolist() == [3, 4, 5, 6, 7]
    assert torch.cat(moments._span(parts, 6, 4)).tolist() == [6, 7, 8, 9]
    assert [view.numel() for view in moments._span(parts, 1, 2)] == [2]


def test_moments_that_miss_a_trained_parameter_are_refused_in_one_line_naming_the_checkpoint(tmp_path):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    step = torch.tensor(1.0)  # ZeRO keeps one per group: every parameter cut from it gets this tensor
    saved = {"weight": {"step": step, "exp_avg": torch.ones(2, 2), "exp_avg_sq": torch.ones(2, 2)}}
    refused = f"^train.resume: {tmp_path}: optimizer state covers 1 of 2 trained"
    with pytest.raises(UserError, match=refused), resume._naming(tmp_path):
        moments.into_plain(model, optimizer, saved)
    assert not optimizer.state  # nothing half-loaded
    saved["bias"] = {"step": step, "exp_avg": torch.ones(2), "exp_avg_sq": torch.ones(2)}
    moments.into_plain(model, optimizer, saved)
    steps = [state["step"] for state in optimizer.state.values()]
    assert len(steps) == 2 and steps[0] is not steps[1]  # Adam counts each in place: never one shared tensor
