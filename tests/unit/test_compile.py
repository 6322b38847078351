"""Compiled blocks (`model.compile`): every decoder block runs one compiled graph, with no graph break in it
and no recompilation as packed widths and the batch size change from step to step, and each training step's
loss and gradients equal the eager model's on the same weights, whichever instruction set the CPU's kernels
use. Inductor compiles for this CPU (a C++ compiler is all it needs)."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

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
# The tolerances follow from float32 and the model's widths. A float32 sum of K terms taken in another order
# (another vector width, another tiling) moves by about sqrt(K) * eps of its magnitude (rounding errors of
# random sign; K * eps at worst). The embedded model's longest sums are its MLP's 640 terms, and the loss
# is a mean of log-probabilities each one such chain deep per layer: twice sqrt(640) * eps = 5.7e-6
# relative. A gradient runs the chain forward and back through the 4 layers: 2 * 4 times the loss's bound,
# 4.6e-5 relative, taken over the norm of all trained gradients together (a single tiny gradient has no
# relative accuracy to speak of). Measured on an AVX-512 CPU under ATEN_CPU_CAPABILITY=avx512, avx2 and
# default (scalar): at most 6.2e-7 for the loss and 9.4e-6 for the gradients. Comparing whole training
# curves instead is not a numerical test: AdamW's first steps move a weight by about the learning rate
# whatever the sign of a near-zero gradient, so a rounding difference of 1e-7 grows to 3e-4 within 5 steps.
EPS = torch.finfo(torch.float32).eps
WIDEST, LAYERS = 640, 4
LOSS_RTOL = 2 * math.sqrt(WIDEST) * EPS
GRAD_RTOL = 2 * LAYERS * LOSS_RTOL


def packed_batches(vocab: int, steps: int = STEPS, seed: int = 0) -> list[dict]:
    """`steps` packed batches of ROWS rows, 1 to 3 examples a row, the widest row of step k 10 + 3k tokens:
    every step a width of its own. The batch size stays: the training loader drops an epoch's short
    remainder."""
    gen = np.random.default_rng(seed)
    batches = []
    for step in range(steps):
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


def compiled_against_eager(batches: list[dict], after_first=lambda: None) -> dict:
    """LoRA training with compiled blocks on the embedded tiny model (with the chunked head's first call,
    which probes the model in eval mode). Before each step the same batch runs through the model loaded
    without compilation, given the same weights. Returns each step's relative gap of the loss and of the
    gradients' norm; `after_first` is called once the first step is done."""
    compiled, eager = lora_model(compile=True), lora_model(compile=False)
    trained = [p for p in compiled.parameters() if p.requires_grad]
    mirrored = [p for p in eager.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    gaps = {"loss": [], "grads": []}
    for step, batch in enumerate(batches):
        with torch.no_grad():
            for mirror, p in zip(mirrored, trained, strict=True):
                mirror.copy_(p)
        eager_loss, eager_grads = loss_and_grads(eager, batch)
        eager.zero_grad()
        loss, grads = loss_and_grads(compiled, batch)
        gaps["loss"].append(abs(loss - eager_loss) / abs(eager_loss))
        gaps["grads"].append(float((grads - eager_grads).norm() / eager_grads.norm()))
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            after_first()
    return gaps


def lora_model(compile: bool):
    cfg = load_config(None, [])
    torch.manual_seed(0)
    model = load_model(cfg.model, cfg.lora, 0, SpeedFeatures("sdpa", False, compile, False), loss=cfg.loss)
    return model.train()


def loss_and_grads(model, batch) -> tuple[float, torch.Tensor]:
    """The batch's mean token loss and the trained weights' gradients, flat (left in place for a step)."""
    loss = batch_loss(model, batch) / count_targets(batch["labels"])
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def assert_within_tolerance(gaps: dict) -> None:
    assert max(gaps["loss"]) <= LOSS_RTOL, gaps["loss"]
    assert max(gaps["grads"]) <= GRAD_RTOL, gaps["grads"]


def test_compiled_blocks_train_like_eager_without_breaks_or_recompiles():
    torch._dynamo.reset()
    counters.clear()
    batches = packed_batches(vocab=500)
    assert len({b["input_ids"].shape[1] for b in batches}) == STEPS
    graphs_after_first = []
    gaps = compiled_against_eager(
        batches, lambda: graphs_after_first.append(counters["stats"]["unique_graphs"])
    )

    assert counters["graph_break"] == {}, dict(counters["graph_break"])
    # One graph serves every block (the head's eval-mode probe runs them eagerly) and one the chunked head's
    # fused math, both made in the first step: the 19 steps after it, each a width of its own, compiled
    # nothing.
    assert graphs_after_first == [2]
    assert counters["stats"]["unique_graphs"] == graphs_after_first[0], "a later step recompiled"
    assert_within_tolerance(gaps)


def capabilities() -> list:
    """The CPU kernel sets to check besides this CPU's own: scalar code everywhere, AVX2 on an x86 CPU
    that has AVX-512 (torch's default there when AVX-512 is missing). On a CPU whose own set is AVX2, the
    in-process test above already runs AVX2's kernels and Inductor's 256-bit code: a second process would
    compile and check the very same code again."""
    own = torch.backends.cpu.get_cpu_capability()
    avx512 = platform.machine() in ("x86_64", "AMD64") and own == "AVX512"
    reason = "this CPU's own kernels are AVX2's: checked in process" if own == "AVX2" else "no AVX2 here"
    return ["default", pytest.param("avx2", marks=pytest.mark.skipif(not avx512, reason=reason))]


# ATEN_CPU_CAPABILITY is read as torch starts, so each kernel set runs in a process of its own; Inductor
# picks its vector width from it too. Each gets an Inductor cache of its own: Inductor's local cache does
# not key its generated code on that variable, and code vectorized for another width, compiled again for
# this one, fails to build or computes garbage.
CHECK = """
import json, sys
sys.path.insert(0, {tests!r})
from torch._inductor.cpu_vec_isa import pick_vec_isa
import test_compile as t
gaps = t.compiled_against_eager(t.packed_batches(vocab=500, steps=6))
print(json.dumps({{"bits": pick_vec_isa().bit_width(), **gaps}}))
"""


@pytest.mark.parametrize("capability", capabilities())
def test_compiled_blocks_match_eager_on_other_cpu_kernels(capability, tmp_path):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    env["OMP_NUM_THREADS"] = "1"
    code = CHECK.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    gaps = json.loads(done.stdout.strip().splitlines()[-1])
    # Inductor's code really was built for that width (0: scalar), not this CPU's own.
    assert gaps.pop("bits") == {"default": 0, "avx2": 256}[capability]
    assert_within_tolerance(gaps)
