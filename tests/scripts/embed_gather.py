"""Under torchrun (2 gloo processes): the contrastive loss of toolkit/embed/loss.py on each process's half
of a batch (a float64 linear encoder, one hard negative per row, a Matryoshka size), once in one pass and
once cached (two micro-batches embedded without gradients, then re-run with the loss's gradient). Writes
the loss and the encoder's gradient summed over the processes, both ways, to --out as JSON."""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit.embed.loss import cached_gradients, step_terms, surrogate
from toolkit.entry import leave

ROWS, WIDTH, TEMPERATURE, DIMS = 8, 8, 0.05, [4]


def whole_batch() -> tuple[torch.nn.Linear, dict[str, torch.Tensor]]:
    """The encoder and the batch's features by group (anchor, positive, negative), from a fixed seed."""
    torch.manual_seed(0)
    encoder = torch.nn.Linear(12, WIDTH).double()
    return encoder, {
        name: torch.randn(ROWS, 12, dtype=torch.float64) for name in ("anchor", "positive", "negative")
    }


def stacked(features: dict[str, torch.Tensor], rows: slice) -> torch.Tensor:
    """`rows` of every group, stacked as the collator stacks a batch."""
    return torch.cat([features[name][rows] for name in ("anchor", "positive", "negative")])


def summed(encoder, loss: torch.Tensor) -> dict:
    grad = torch.cat([p.grad.flatten() for p in encoder.parameters()])
    both = torch.cat([loss.detach().reshape(1), grad])
    dist.all_reduce(both)
    encoder.zero_grad()
    return {"loss": both[0].item(), "grad": both[1:].tolist()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, half = dist.get_rank(), ROWS // 2
    encoder, features = whole_batch()
    mine = slice(rank * half, (rank + 1) * half)

    terms = step_terms(encoder(stacked(features, mine)), 1, TEMPERATURE, DIMS)
    terms.loss_sum.backward()
    one_pass = summed(encoder, terms.loss_sum)

    micro = [slice(mine.start + i, mine.start + i + half // 2) for i in (0, half // 2)]
    with torch.no_grad():
        vectors = [encoder(stacked(features, rows)) for rows in micro]
    terms, grads = cached_gradients(vectors, 1, TEMPERATURE, DIMS)
    for rows, grad in zip(micro, grads, strict=True):
        surrogate(encoder(stacked(features, rows)), grad).backward()
    cached = summed(encoder, terms.loss_sum)
    if rank == 0:
        args.out.write_text(json.dumps({"one_pass": one_pass, "cached": cached}))


if __name__ == "__main__":
    leave(main)
