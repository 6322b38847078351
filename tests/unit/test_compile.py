"""Compiled blocks (`model.compile`): every decoder block runs one compiled graph, with no graph break in it
and no recompilation as packed widths and the batch size change from step to step, and training follows
the eager model's losses. Inductor compiles for this CPU (a C++ compiler is all it needs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from toolkit import data
from toolkit.config import load_config
from toolkit.data.encode import IGNORE
from toolkit.model.load import load_model
from toolkit.model.speed import SpeedFeatures, can_compile
from toolkit.train.loss import batch_loss, count_targets

pytestmark = pytest.mark.skipif(not can_compile(), reason="torch.compile needs a C++ compiler here")
STEPS, ROWS = 20, 3


def packed_batches(vocab: int, seed: int = 0) -> list[dict]:
    """STEPS packed batches of ROWS rows, 1 to 3 examples a row, the widest row of step k 10 + 3k tokens:
    every step a width of its own. The batch size stays: the training loader drops an epoch's short
    remainder."""
    gen = np.random.default_rng(seed)
    batches = []
    for step in range(STEPS):
        packed = []
        for row in range(ROWS):
            width = 10 + 3 * step - int(gen.integers(1, 8) if row else 0)
            cuts = sorted(gen.choice(np.arange(1, width), size=int(gen.integers(0, 3)), replace=False))
            lengths = np.diff([0, *cuts, width]).tolist()
            ids = gen.integers(3, vocab, size=sum(lengths)).tolist()
            positions = [p for n in lengths for p in range(n)]
            labels = [IGNORE if p == 0 else t for p, t in zip(positions, ids, strict=True)]
            packed.append({"input_ids": ids, "labels": labels, "position_ids": positions})
        batches.append(data.PackedCollator(pad_id=0, multiple=1)(packed))
    return batches


def trained(compiled: bool, batches: list[dict], after_first=lambda: None) -> list[float]:
    """Per-step mean token losses of LoRA steps on the embedded tiny model (with the chunked head's first
    call, which probes the model in eval mode); `after_first` is called once the first step is done."""
    cfg = load_config(None, [])
    torch.manual_seed(0)
    model = load_model(cfg.model, cfg.lora, 0, SpeedFeatures("sdpa", False, compiled, False), loss=cfg.loss)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for batch in batches:
        loss = batch_loss(model, batch) / count_targets(batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if len(losses) == 1:
            after_first()
    return losses


def test_compiled_blocks_train_like_eager_without_breaks_or_recompiles():
    torch._dynamo.reset()
    counters.clear()
    batches = packed_batches(vocab=500)
    assert len({b["input_ids"].shape[1] for b in batches}) == STEPS
    graphs_after_first = []
    compiled = trained(True, batches, lambda: graphs_after_first.append(counters["stats"]["unique_graphs"]))
    eager = trained(False, batches)

    assert counters["graph_break"] == {}, dict(counters["graph_break"])
    # One graph serves every block (the head's eval-mode probe runs them eagerly) and one the chunked
    # head's fused math, both made in the first step: the 19 steps after it, each a width of its own,
    # compiled nothing.
    assert graphs_after_first == [2]
    assert counters["stats"]["unique_graphs"] == graphs_after_first[0], "a later step recompiled"
    np.testing.assert_allclose(compiled, eager, rtol=0, atol=1e-5)
