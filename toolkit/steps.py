"""The per-step machinery every recipe's loop shares: counts summed across ranks, the update (clipping,
the non-finite guard, optimizer and scheduler), and the end of a step (checkpoint cadence, stop requests,
failures), plus the end of the run (final checkpoint, export). The loss is each recipe's own."""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit import checkpoint, distributed, export
from toolkit.errors import UserError
from toolkit.nonfinite import NonFiniteGuard
from toolkit.preemption import PREEMPTED_EXIT_CODE, StopRequest


def global_counts(accelerator, counts: list[int]) -> list[int]:
    """Collective: this rank's per-step counts summed over every rank."""
    return accelerator.reduce(torch.tensor(counts, device=accelerator.device), reduction="sum").tolist()


def apply_update(
    accelerator, model, optimizer, scheduler, guard: NonFiniteGuard, step: int, loss: float, max_norm: float
) -> float:
    """Clip (returning the norm before clipping), then step optimizer and scheduler unless the guard
    drops this step; gradients are cleared either way."""
    grad_norm = float(distributed.clip_grad_norm(accelerator, model, max_norm))
    if guard.allows_update(step, loss, grad_norm):
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad()
    return grad_norm


def every(step: int, period: int, last_step: int = 0) -> bool:
    """True every `period` steps (never for 0) and at `last_step`."""
    return bool(period) and step % period == 0 or step == last_step


def end_of_step(
    accelerator,
    cfg,
    output_dir: Path,
    step: int,
    state: dict,
    schedule: checkpoint.SaveSchedule,
    guard: NonFiniteGuard,
    stop: StopRequest,
    progress,
) -> int | None:
    """Collective: checkpoint when due or stopping (never weights a non-finite update reached), then the
    exit code when the run must stop now (a stop request: PREEMPTED_EXIT_CODE; a failure: UserError),
    with the progress bar closed first so the last line printed says why."""
    stopping, save_due = distributed.any_rank(
        accelerator, stop.requested or bool(guard.failure), schedule.due(step)
    )
    if (save_due or stopping) and guard.weights_intact:
        checkpoint.save_checkpoint(accelerator, output_dir, step, state, cfg)
        schedule.saved(step)
        if accelerator.is_main_process and (cfg.train.keep_last or cfg.train.keep_best):
            checkpoint.prune_checkpoints(output_dir, cfg.train.keep_last, cfg.train.keep_best)
    if not stopping:
        return None
    progress.close()
    if guard.failure:
        raise UserError(guard.failure)
    accelerator.print(
        f"stopped by {stop.signal_name or 'another rank'} after step {step}; checkpoint saved, "
        "launch again with train.resume=auto to continue"
    )
    return PREEMPTED_EXIT_CODE


def final_checkpoint(accelerator, cfg, output_dir: Path, schedule: checkpoint.SaveSchedule, state: dict):
    """Collective: the last step's checkpoint, unless the schedule just wrote it."""
    if schedule.last_step < cfg.train.max_steps:
        checkpoint.save_checkpoint(accelerator, output_dir, cfg.train.max_steps, state, cfg)


def export_final(accelerator, model, tokenizer, cfg, output_dir: Path) -> Path:
    """Collective: the trained model as Hugging Face files in output_dir/final (and final/merged on
    request for adapters)."""
    final_dir = output_dir / "final"
    export.export_model(accelerator, model, tokenizer, final_dir, cfg.export.dtype)
    if cfg.model.adapter and cfg.model.method != "full" and accelerator.is_main_process:
        export.keep_start_adapter(final_dir, cfg.model.adapter)
    if cfg.export.merge and cfg.model.method != "full" and accelerator.is_main_process:
        export.merge_adapter(final_dir, final_dir / "merged", cfg.export.dtype)
    accelerator.wait_for_everyone()
    accelerator.print(
        f"saved: {final_dir.resolve()}  (try: ftkit generate --model {final_dir} --prompt '...')"
    )
    return final_dir
