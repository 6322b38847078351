"""The Pipeline a recipe steps: this process's stages under a torch.distributed.pipelining schedule, one
schedule step per optimizer step (its micro-batches are the step's `grad_accum` micro-batches), the
gradients of each stage averaged over its data-parallel replicas, and the norm taken over every stage.

The processes of one pipeline are neighbours (accelerate's mesh dimension `tp` holds them: ranks that share
their batches and need no DDP wrapper), replicas of a stage sit `pipeline.size` ranks apart (`dp_shard`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.utils._pytree import tree_map

from toolkit.pipeline import stages as stage_split
from toolkit.pipeline.batches import pipeline_width, stacked

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


@dataclass
class Cut:
    """A model trimmed to one process's stages (`cut`)."""

    split: list[int]
    """Decoder layers of every stage, first to last."""
    stage_ids: list[int]
    """The stages this process holds."""
    modules: list
    """Their `stages.Stage` modules, in the order of `stage_ids`."""


def cut(model, cfg, accelerator) -> Cut:
    """`model` trimmed to this process's stages (pipeline rank r holds stages r, r + size, ...) and moved
    to its device: a GPU never holds the whole model."""
    rank = accelerator.torch_device_mesh["tp"].get_local_rank()
    n_stages = cfg.size * cfg.chunks_per_process
    stage_ids = [rank + k * cfg.size for k in range(cfg.chunks_per_process)]
    split = stage_split.layer_split(model, n_stages, cfg.layers)
    modules = stage_split.trim(model, split, stage_ids)
    model.to(accelerator.device)
    return Cut(split, stage_ids, modules)


class Pipeline:
    """This process's part of the pipeline. `loss_fn(logps, labels)` turns the last stage's per-token
    log-probs of one micro-batch into its summed loss (the step's scale is applied here): the loss of
    `step`; `run_step` takes any other. Micro-batches are `rows` rows of data.max_length tokens; `uniform`:
    the loss weighs every token alike (see `stages.Stage`)."""

    def __init__(
        self,
        model,
        cut: Cut,
        cfg,
        accelerator,
        grad_accum: int,
        rows: int,
        max_length: int,
        pad_id: int,
        loss_fn,
        uniform,
    ):
        mesh = accelerator.torch_device_mesh
        self.accelerator, self.model, self.cfg = accelerator, model, cfg
        self.group = mesh["tp"].get_group()
        self.replicas = mesh["dp_shard"].get_group() if "dp_shard" in mesh.mesh_dim_names else None
        self.size = cfg.size
        self.rows, self.width, self.pad_id, self.grad_accum = (
            rows,
            pipeline_width(max_length),
            pad_id,
            grad_accum,
        )
        self.loss_fn = loss_fn
        self.split, self.stage_ids, self.modules = cut.split, cut.stage_ids, cut.modules
        n_stages = cfg.size * cfg.chunks_per_process
        self.first, self.last = 0 in self.stage_ids, n_stages - 1 in self.stage_ids
        # What accelerate reads to accept, without a DDP wrapper, a model split before `prepare`.
        stage_split.causal_lm(model)._tp_size = cfg.size
        self.schedule = self._schedule(grad_accum, self._scaled_loss)
        self.eval_schedule = None
        self._loss, self._scale, self._records = loss_fn, 1.0, []
        self._busy = self._wall = 0.0
        for module in self.modules:
            module.uniform = uniform

    def _schedule(self, n_microbatches: int, loss_fn):
        device = self.accelerator.device
        n_stages = self.size * self.cfg.chunks_per_process
        built = [
            PipelineStage(module, i, n_stages, device, group=self.group)
            for module, i in zip(self.modules, self.stage_ids)
        ]
        for stage in built:
            self._timed(stage)
        kind = SCHEDULES[self.cfg.schedule]
        stages = built if kind is ScheduleInterleaved1F1B else built[0]
        # The loss is already normalised over the step's target tokens: no division by micro-batches.
        return kind(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)

    def _timed(self, stage) -> None:
        """Count the time `stage` computes (its forward and backward chunks): the rest of a step is the
        pipeline's bubble and its communication."""

        def timed(run):
            def wrapper(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return run(*args, **kwargs)
                finally:
                    self._busy += time.perf_counter() - started

            return wrapper

        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, timed(getattr(stage, name)))

    @property
    def idle_fraction(self) -> float:
        """Share of the last training step this process spent not computing (bubble, sends, waits)."""
        return max(0.0, 1 - self._busy / self._wall) if self._wall else 0.0

    def describe(self) -> str:
        chunks = self.cfg.chunks_per_process
        per = f", {chunks} chunks per process" if chunks > 1 else ""
        return (
            f"pipeline: {self.size} processes{per}, {self.cfg.schedule}, {self.grad_accum} micro-batches per "
            f"step; decoder layers per stage {self.split}"
        )

    def step(self, micro_batches: list[dict], scale: float) -> torch.Tensor:
        """Collective: forward and backward of the step's micro-batches under the Pipeline's `loss_fn`
        (each micro-batch's loss times `scale`, the factor the recipe gives it); returns the step's summed
        loss on every rank of the pipeline."""
        records = self.run_step(micro_batches, self.loss_fn, scale)
        total = sum((-row_sums.sum() for row_sums, _ in records), self._zeros(()))
        return self.share(total).float()

    def run_step(self, micro_batches: list[dict], loss_fn, scale: float = 1.0, targets=None) -> list[tuple]:
        """Collective: forward and backward of the step's micro-batches, each micro-batch's loss
        `loss_fn(token_logps, target)` times `scale` (`targets`: one tensor of per-row values per
        micro-batch, else its labels). Gradients are then averaged over the replicas. Returns, on the last
        stage, each micro-batch's (per-row summed log-probs, target), detached; elsewhere []."""
        inputs = self._inputs(micro_batches)
        target = inputs[3] if targets is None else torch.cat(targets).to(self.accelerator.device)
        # The recipe's scale counts on a backend dividing by the accumulation steps; the schedule does not.
        self._loss, self._scale, self._records = loss_fn, scale / self.grad_accum, []
        self._busy, started = 0.0, time.perf_counter()
        with self.accelerator.autocast():
            self._run(self.schedule, inputs, target)
        self._wall = time.perf_counter() - started
        self._average_over_replicas()
        # The first step also scores the shape-inference pass on unfilled buffers: keep the real ones.
        return self._records[-self.grad_accum :] if self.last else []

    @torch.no_grad()
    def forward_logps(self, batches: list[dict]) -> list[torch.Tensor]:
        """Collective, forward only in eval mode: each batch's per-row summed log-probs of its label tokens
        (float64), on every rank of the pipeline; at most `grad_accum` batches a call."""
        row_sums = self._forward(batches, "target").double().sum(dim=1)
        return [row_sums[i * self.rows : i * self.rows + len(b["input_ids"])] for i, b in enumerate(batches)]

    @torch.no_grad()
    def next_tokens(self, rows: list[list[int]]) -> list[int]:
        """Collective, forward only: the greedy next token after each of `rows` (token ids, at most one
        micro-batch), on every rank of the pipeline."""
        ids = torch.full((len(rows), self.width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
        batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.full_like(ids, -100)}
        picked = self._forward([batch], "argmax")
        return [int(picked[i, len(row) - 1]) for i, row in enumerate(rows)]

    def _forward(self, batches: list[dict], output: str) -> torch.Tensor:
        """The last stage's [rows, width] output (`Stage.output`) for `batches` padded up to a step's, on
        every rank of the pipeline."""
        if self.eval_schedule is None:
            self.eval_schedule = self._schedule(self.grad_accum, None)
        empty = {key: value[:0] for key, value in batches[0].items()}
        inputs = self._inputs(batches + [empty] * (self.grad_accum - len(batches)))
        self.model.eval()
        for module in self.modules:
            module.output = output
        try:
            with self.accelerator.autocast():
                outputs = self._run(self.eval_schedule, inputs, inputs[3])
        finally:
            self.model.train()
            for module in self.modules:
                module.output = "target"
        found = outputs.float() if self.last else torch.zeros(inputs[0].shape, device=self.accelerator.device)
        return self.share(found)

    def eval_sum(self, batches: list[dict]) -> torch.Tensor:
        """Collective: summed token loss of `batches` (at most `grad_accum`), on every pipeline rank."""
        return -torch.cat(self.forward_logps(batches)).sum()

    def share(self, values: torch.Tensor) -> torch.Tensor:
        """Collective: `values` summed over the pipeline's processes (the last stage's, where only it has
        them)."""
        dist.all_reduce(values, group=self.group)
        return values

    def _zeros(self, shape) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float64, device=self.accelerator.device)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip every stage's gradients by the norm over all stages (as torch clips one model); returns the
        norm before clipping."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float64, device=self.accelerator.device)
        for grad in grads:
            squares += grad.double().pow(2).sum()
        dist.all_reduce(squares, group=self.group)
        norm = squares.sqrt()
        limit = max_norm if max_norm > 0 else math.inf
        coef = torch.clamp(limit / (norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coef.to(grad.dtype))
        return norm.float()

    def _inputs(self, micro_batches):
        tensors = stacked(micro_batches, self.rows, self.width, self.pad_id)
        return tree_map(lambda t: t.to(self.accelerator.device), tensors)

    def _run(self, schedule, inputs, target):
        if self.first:
            return schedule.step(*inputs)
        if self.last:
            return schedule.step(target=target, losses=[] if schedule is self.schedule else None)
        return schedule.step()

    def _scaled_loss(self, logps, target):
        self._records.append((logps.detach().double().sum(dim=1), target))
        return self._loss(logps, target) * self._scale

    def _average_over_replicas(self) -> None:
        if self.replicas is None:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.replicas)
        flat /= dist.get_world_size(self.replicas)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def whole_state_dict(accelerator, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collective: the whole model's state dict on every process of a pipeline, from each one's `own`
    stages' part (on CPU: it is for writing files)."""
    group = accelerator.torch_device_mesh["tp"].get_group()
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, {name: t.detach().cpu() for name, t in own.items()}, group=group)
    return {name: t for part in parts for name, t in part.items()}
