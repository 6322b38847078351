"""AdamW with decay / no-decay groups, learning-rate scaling by world size, and warmup + decay schedules."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from toolkit.config import TrainConfig


def scaled_learning_rate(cfg: TrainConfig, world_size: int) -> float:
    """The peak learning rate after the configured scaling rule (relative to one process)."""
    factor = {"none": 1.0, "linear": world_size, "sqrt": math.sqrt(world_size)}[cfg.lr_scaling]
    return cfg.learning_rate * factor


def build_optimizer(
    model: torch.nn.Module,
    cfg: TrainConfig,
    world_size: int,
    fused: bool = False,
    own_lr: tuple[set[str], float] | None = None,
) -> torch.optim.AdamW:
    """AdamW over trainable parameters; biases and norm weights (1-D tensors) are never decayed.

    `fused` picks torch's single-kernel CUDA implementation (`speed.resolve` decides where it applies);
    `own_lr` (parameter names, peak learning rate) gives those parameters groups of their own, scaled and
    scheduled like the rest (a vision tower's rate).
    """
    lr = scaled_learning_rate(cfg, world_size)
    names, other_lr = own_lr or (set(), lr)
    groups: dict[tuple[bool, bool], list] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            # ZeRO-3 may have partitioned the parameter already (shape [0]); its full shape decides.
            decayed = len(getattr(param, "ds_shape", param.shape)) >= 2
            groups.setdefault((name in names, decayed), []).append(param)
    order = [(False, True), (False, False), (True, True), (True, False)]
    return torch.optim.AdamW(
        [
            {
                "params": groups[key],
                "weight_decay": cfg.weight_decay if key[1] else 0.0,
                **({"lr": other_lr * lr / cfg.learning_rate} if key[0] else {}),
            }
            for key in order
            if key in groups
        ],
        lr=lr,
        betas=tuple(cfg.adam_betas),
        fused=True if fused else None,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> LambdaLR:
    """Linear warmup to the peak, then cosine / linear decay to `min_lr_ratio` of it, or constant."""
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


def lr_factor(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_scheduler == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_scheduler == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each parameter group's settings as this run built them (before any state is loaded into it)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def continue_schedule(optimizer: torch.optim.Optimizer, scheduler: LambdaLR, built: list[dict]) -> None:
    """After a resume: keep the loaded schedule position, but take peak rates, betas and weight decay from
    this run's config (`built`, from `hyperparameters`), so a changed setting applies from here on."""
    scheduler.base_lrs = [group["initial_lr"] for group in built]
    for group, settings, factor in zip(optimizer.param_groups, built, scheduler.lr_lambdas, strict=True):
        group.update({k: v for k, v in settings.items() if k != "lr"})
        group["lr"] = settings["initial_lr"] * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
