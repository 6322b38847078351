"""Step-shaped batching: every optimizer step sees the same examples whatever the world size, micro-batch
and accumulation, and a resumed run continues at the exact micro-batch where it stopped."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from toolkit.config import TrainConfig
from toolkit.errors import UserError


def grad_accum_steps(cfg: TrainConfig, world_size: int) -> int:
    """Accumulation that turns micro-batches on `world_size` processes into the declared global batch."""
    per_step = cfg.micro_batch_size * world_size
    if cfg.global_batch_size % per_step:
        raise UserError(
            f"train.global_batch_size ({cfg.global_batch_size}) is not divisible by train.micro_batch_size "
            f"({cfg.micro_batch_size}) x {world_size} processes"
        )
    return cfg.global_batch_size // per_step


class EpochSampler(Sampler[int]):
    """A fresh permutation per epoch from (seed, epoch), cut to whole global batches.

    Deterministic from its arguments alone, so every rank and every resumed run sees the same order
    without synchronising random states; dropping the ragged tail keeps steps from straddling epochs.
    """

    def __init__(self, num_examples: int, global_batch_size: int, seed: int, shuffle: bool = True):
        if num_examples < global_batch_size:
            raise UserError(
                f"data: {num_examples} training examples, fewer than train.global_batch_size "
                f"({global_batch_size})"
            )
        self.num_examples = num_examples
        self.usable = num_examples // global_batch_size * global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.usable

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.usable))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.num_examples, generator=generator)[: self.usable].tolist())


class StepStream:
    """Yields, per optimizer step, the list of this rank's `grad_accum_steps` micro-batches."""

    def __init__(
        self, loader: DataLoader, sampler: EpochSampler, grad_accum_steps: int, start_step: int, skip_batches
    ):
        self.loader = loader
        self.sampler = sampler
        self.grad_accum_steps = grad_accum_steps
        self.steps_per_epoch = len(loader) // grad_accum_steps
        self.epoch, step_in_epoch = divmod(start_step, self.steps_per_epoch)
        self._skip_batches = skip_batches
        self._iterator = self._open_epoch(step_in_epoch * grad_accum_steps)

    def _open_epoch(self, skip: int):
        self.sampler.set_epoch(self.epoch)
        loader = self._skip_batches(self.loader, skip) if skip else self.loader
        return iter(loader)

    def next_step(self) -> list[dict]:
        batches = []
        while len(batches) < self.grad_accum_steps:
            try:
                batches.append(next(self._iterator))
            except StopIteration:
                self.epoch += 1
                self._iterator = self._open_epoch(0)
        return batches
