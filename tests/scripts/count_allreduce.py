"""Count DDP gradient all-reduces over optimizer steps with gradient accumulation, done the way the recipe
does it (`accelerator.accumulate`), or naively (--naive: a plain backward per micro-batch)."""

import argparse
import json
from pathlib import Path

import torch
from train_tiny import build_model

from toolkit.config import TrainConfig
from toolkit.entry import leave
from toolkit.launch import backend


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--grad-accum", type=int, required=True)
    parser.add_argument("--naive", action="store_true")
    args = parser.parse_args()
    launch = backend.detect_launch()
    train = TrainConfig(global_batch_size=2 * args.grad_accum * launch.world_size, micro_batch_size=2)
    accelerator = backend.setup(launch, train, args.grad_accum)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(accelerator.process_index))
    # The profiler records every collective the DDP reducer issues (its bucket all-reduces included); a
    # Python comm hook would count them too, but leaves Python state on gloo's worker threads that can
    # deadlock the process when the model is freed at exit.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(2):  # optimizer steps
            for _ in range(args.grad_accum):
                if args.naive:
                    accelerator.backward(model(input_ids=ids, labels=ids).loss)
                else:
                    with accelerator.accumulate(model):
                        accelerator.backward(model(input_ids=ids, labels=ids).loss)
            optimizer.step()
            optimizer.zero_grad()
    calls = [e for e in profile.events() if e.name == "gloo:all_reduce"]
    buckets = len(model._get_ddp_logging_data()["bucket_sizes"].split(","))
    if accelerator.is_main_process:
        Path(args.out).write_text(json.dumps({"allreduce_calls": len(calls), "buckets": buckets}))


if __name__ == "__main__":
    leave(main)  # as the recipes end (toolkit/entry.py): no teardown with a gloo group alive
