"""The chunked head's fused per-chunk math (`toolkit/train/fused_head.py`): compiled, it gives today's eager
log-probs and gradients within 1e-5, for every path of the head (a summed loss and a weighted one, a
trained head and a frozen one, a logit scale and soft cap, a last chunk of one row), in one graph with no
graph break."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from toolkit.data.encode import IGNORE
from toolkit.model.speed import can_compile
from toolkit.train.fused_head import chunk_bounds, chunk_math
from toolkit.train.head import LogitShape, score

pytestmark = pytest.mark.skipif(not can_compile(), reason="torch.compile needs a C++ compiler here")
VOCAB, HIDDEN, CHUNK = 300, 32, 16


def scored(rows: int, fused, shape: LogitShape, uniform: bool, trained: bool, seed: int = 0):
    """(log-probs, hidden grad, weight grad, bias grad) of a loss over `rows` rows of 3 positions."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 3, HIDDEN, generator=gen, requires_grad=True)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.3).requires_grad_(trained)
    bias = (torch.randn(VOCAB, generator=gen) * 0.1).requires_grad_(trained)
    targets = torch.randint(0, VOCAB, (rows, 3), generator=gen)
    targets[0, 0] = IGNORE
    logps = score(hidden, weight, bias, targets, CHUNK, uniform, shape, fused)
    weights = torch.ones_like(logps) if uniform else torch.rand(logps.shape, generator=gen)
    (logps * weights).sum().backward()
    return logps.detach(), hidden.grad, weight.grad, bias.grad


@pytest.mark.parametrize("uniform", [True, False], ids=["summed", "weighted"])
@pytest.mark.parametrize("trained", [True, False], ids=["trained head", "frozen head"])
@pytest.mark.parametrize("scale, softcap", [(1.0, None), (0.25, 3.0)], ids=["plain", "scaled and capped"])
def test_fused_math_gives_the_eager_heads_log_probs_and_gradients(uniform, trained, scale, softcap):
    shape = LogitShape(None, 1 / scale, softcap)
    fused = chunk_math(shape.scale, shape.softcap)
    # 3 x 11 = 33 positions, 32 targets: two chunks of 16; 3 x 17 = 51 positions, 50 targets: a last one
    # of two rows; 23 rows of 3 = 69 positions, 68 targets: a last chunk of 4.
    for rows in (11, 17, 23):
        eager = scored(rows, None, shape, uniform, trained)
        compiled = scored(rows, fused, shape, uniform, trained)
        for name, want, got in zip(("logps", "hidden", "weight", "bias"), eager, compiled, strict=True):
            if want is None:
                assert got is None, name
                continue
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=name)


def test_one_graph_without_breaks_serves_every_chunk_width():
    torch._dynamo.reset()
    counters.clear()
    shape = LogitShape(None, 1.0, None)
    fused = chunk_math(shape.scale, shape.softcap)
    for rows in (11, 17, 23, 6):
        scored(rows, fused, shape, uniform=True, trained=False)
    assert counters["graph_break"] == {}, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1


def test_a_last_chunk_of_one_row_joins_the_one_before_under_the_fused_math():
    assert chunk_bounds(33, 16, fused=True) == [slice(0, 16), slice(16, 33)]
    assert chunk_bounds(33, 16, fused=False) == [slice(0, 16), slice(16, 32), slice(32, 33)]
    assert chunk_bounds(1, 16, fused=True) == [slice(0, 1)]
    assert chunk_bounds(0, 16, fused=True) == []
