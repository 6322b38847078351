"""Where a training step's GPU time goes: ftkit's own loading (LoRA r16, the chunked head, compiled blocks,
flex attention for packed rows) of the GPU check's 1B shape, packed rows of random tokens, bf16 autocast and
fused AdamW; torch's profiler over a few steps after the compiled warm-up, its top kernels printed.

    python bench/gpu_profile.py [--work DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from gpu_models import build

from toolkit import data
from toolkit.config import load_config
from toolkit.data.encode import IGNORE
from toolkit.model.load import load_model
from toolkit.model.speed import SpeedFeatures
from toolkit.train.loss import batch_loss, count_targets
from toolkit.train.optim import build_optimizer

ROWS, WIDTH = 4, 2048


def packed_batch(vocab: int, generator: torch.Generator) -> dict:
    """ROWS rows of WIDTH tokens, each several examples of 200 to 900 tokens (the last one cut to fit)."""
    rows = []
    for _ in range(ROWS):
        lengths, left = [], WIDTH
        while left > 0:
            lengths.append(min(left, int(torch.randint(200, 900, (), generator=generator))))
            left -= lengths[-1]
        ids = torch.randint(3, vocab, (WIDTH,), generator=generator).tolist()
        positions = [p for n in lengths for p in range(n)]
        labels = [IGNORE if p == 0 else t for p, t in zip(positions, ids, strict=True)]
        rows.append({"input_ids": ids, "labels": labels, "position_ids": positions})
    return data.PackedCollator(pad_id=0)(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path(tempfile.mkdtemp(prefix="ftkit-profile-")))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    path = build("llama-1b", args.work / "models" / "llama-1b", smoke=not cuda)
    cfg = load_config(None, [f"model.path={path}", "model.dtype=bfloat16" if cuda else "model.dtype=float32"])
    features = SpeedFeatures("flex_attention" if cuda else "sdpa", False, True, cuda)
    device = torch.device("cuda" if cuda else "cpu")
    model = load_model(cfg.model, cfg.lora, 0, features, loss=cfg.loss).to(device)
    optimizer = build_optimizer(model, cfg.train, 1, fused=cuda)
    generator = torch.Generator().manual_seed(0)
    batches = [packed_batch(model.config.vocab_size, generator) for _ in range(3 + args.steps)]

    def step(batch: dict) -> None:
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = batch_loss(model, batch) / count_targets(batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    started = time.monotonic()
    for batch in batches[:3]:
        step(batch)
    torch.cuda.synchronize() if cuda else None
    print(f"warm-up (3 steps, compilation included): {time.monotonic() - started:.1f} s", flush=True)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else []
    )
    with torch.profiler.profile(activities=activities) as profile:
        for batch in batches[3:]:
            step(batch)
        torch.cuda.synchronize() if cuda else None
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(profile.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70))


if __name__ == "__main__":
    main()
