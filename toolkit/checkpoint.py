"""Checkpoints under output_dir/checkpoints/step-<N>: written to a temporary directory by every rank and
renamed into place with a completion marker, so a crash mid-save never leaves a directory that loads."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from accelerate.utils import DistributedType

from toolkit.config import RecipeConfig, save_config
from toolkit.distributed import any_rank
from toolkit.errors import UserError

MARKER = "ftkit_checkpoint.json"
CONFIG = "config.yaml"


def checkpoint_dir(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    root = checkpoint_dir(output_dir)
    done = (
        [p for p in root.glob("step-*") if p.name[5:].isdigit() and is_complete(p)] if root.is_dir() else []
    )
    return max(done, key=lambda p: int(p.name[5:]), default=None)


def resolve_resume(output_dir: Path, resume: str, overwrite: bool) -> Path | None:
    """Which checkpoint to start from (None: fresh), refusing to mix a fresh run into another run's files."""
    if resume not in ("auto", "never"):
        path = Path(resume)
        if not is_complete(path):
            raise UserError(f"train.resume: {resume} is not a complete checkpoint (no {MARKER})")
        return path
    latest = latest_checkpoint(output_dir) if resume == "auto" and not overwrite else None
    if latest is None and _holds_a_run(output_dir) and not overwrite:
        raise UserError(
            f"output_dir: {output_dir} holds another run; set train.overwrite=true to replace it"
            + (" or train.resume=auto to continue it" if resume == "never" else "")
        )
    return latest


def clear_output_dir(output_dir: Path) -> None:
    """Empty output_dir before a fresh run (only reached when resolve_resume allowed it)."""
    if output_dir.is_dir():
        for child in output_dir.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()


def prepare_output_dir(accelerator, output_dir: Path, cfg: RecipeConfig, fresh: bool) -> None:
    """A fresh run starts in an empty output_dir (cleared if allowed) with its config saved."""
    accelerator.wait_for_everyone()  # every rank has looked at output_dir before it changes
    if fresh and accelerator.is_main_process:
        clear_output_dir(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, output_dir / "config.yaml")
    accelerator.wait_for_everyone()


def _holds_a_run(output_dir: Path) -> bool:
    return output_dir.is_dir() and any(output_dir.iterdir())


class SaveSchedule:
    """Checkpoint every N steps and/or every M minutes (a rank's clock only proposes; ranks agree)."""

    def __init__(self, every_steps: int, every_minutes: float, start_step: int):
        self.every_steps = every_steps
        self.every_seconds = every_minutes * 60
        self.last = time.monotonic()
        self.last_step = start_step

    def due(self, step: int) -> bool:
        by_step = bool(self.every_steps) and step % self.every_steps == 0
        return by_step or bool(self.every_seconds) and time.monotonic() - self.last >= self.every_seconds

    def saved(self, step: int) -> None:
        self.last = time.monotonic()
        self.last_step = step


def save_checkpoint(
    accelerator, output_dir: Path, step: int, state: dict, config: RecipeConfig | None = None
) -> Path:
    """Collective: every rank calls this; returns the finished checkpoint directory.

    The marker records `state`, the step and the `layout`; `config` (the run's resolved recipe config) is
    saved beside it, so that export and resume under another backend need nothing but the checkpoint.
    A failed write (disk full, permissions) on any rank raises UserError on every rank, removes the
    partial directory and leaves the previous checkpoint as the newest valid one.
    """
    root = checkpoint_dir(output_dir)
    final, tmp = root / f"step-{step}", root / f".step-{step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    error = _attempt(lambda: accelerator.save_state(str(tmp)))
    _agree_or_raise(accelerator, error, tmp, final, output_dir)
    if accelerator.is_main_process:
        marker = {**state, **layout(accelerator), "step": step}
        error = _attempt(lambda: _finalize(tmp, final, marker, config))
    _agree_or_raise(accelerator, error if accelerator.is_main_process else "", tmp, final, output_dir)
    return final


def prune_checkpoints(output_dir: Path, keep_last: int, keep_best: bool) -> list[Path]:
    """Delete all but the `keep_last` newest complete checkpoints (and the best by eval loss); main only."""
    done = sorted(
        (p for p in checkpoint_dir(output_dir).glob("step-*") if is_complete(p)),
        key=lambda p: int(p.name[5:]),
    )
    keep = set(done[-keep_last:]) if keep_last else set(done)
    scored = [(json.loads((p / MARKER).read_text()).get("eval_loss"), p) for p in done]
    scored = [(loss, p) for loss, p in scored if loss is not None]
    if keep_best and scored:
        keep.add(min(scored, key=lambda item: item[0])[1])
    removed = [p for p in done if p not in keep]
    for path in removed:
        shutil.rmtree(path)
    return removed


def _attempt(action) -> str:
    try:
        action()
    except OSError as exc:
        return f"{exc.strerror or exc} ({exc.filename or ''})".replace(" ()", "")
    return ""


def _finalize(tmp: Path, final: Path, marker: dict, config: RecipeConfig | None) -> None:
    if config is not None:
        save_config(config, tmp / CONFIG)
    marker["files"] = _manifest(tmp)
    (tmp / MARKER).write_text(json.dumps(marker, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def _agree_or_raise(accelerator, error: str, tmp: Path, final: Path, output_dir: Path) -> None:
    if not any_rank(accelerator, bool(error))[0]:
        accelerator.wait_for_everyone()
        return
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    previous = latest_checkpoint(output_dir)
    still = (
        f"{previous.name} is still the newest valid checkpoint"
        if previous
        else "no earlier checkpoint exists"
    )
    raise UserError(f"{final}: checkpoint not written: {error or 'failed on another rank'}; {still}")


def load_checkpoint(accelerator, path: Path, model, optimizer) -> dict:
    """Restore model, optimizer, scheduler and RNG states; return the marker (step and counters).

    `model` and `optimizer` are the prepared ones, the only ones `accelerator` holds.
    """
    accelerator.load_state(str(path))
    _reload_fsdp1_optimizer(path, model, optimizer)
    return read_marker(path)


def _reload_fsdp1_optimizer(path: Path, model, optimizer) -> None:
    """Collective: read FSDP1's sharded optimizer state again, by the names the checkpoint holds.

    Accelerate reads it into the state a fresh optimizer has, which is empty, so the moments would
    silently restart at zero; torch's reader takes its keys from the checkpoint itself.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    directory = path / "optimizer_0"
    if not isinstance(model, FullyShardedDataParallel) or not directory.is_dir():
        return
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        saved = load_sharded_optimizer_state_dict(
            model_state_dict=model.state_dict(),
            optimizer_key="optimizer",
            storage_reader=FileSystemReader(str(directory)),
        )["optimizer"]
        optimizer.load_state_dict(FullyShardedDataParallel.optim_state_dict_to_load(model, optimizer, saved))


def read_marker(path: Path) -> dict:
    if not is_complete(path):
        raise UserError(f"{path}: not a complete checkpoint (no {MARKER})")
    return json.loads((path / MARKER).read_text())


def layout(accelerator) -> dict:
    """How this launch lays out the states it saves; a checkpoint with another layout needs portable.py."""
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    return {
        "backend": accelerator.distributed_type.value,
        "world_size": accelerator.num_processes,
        "zero_stage": accelerator.state.deepspeed_plugin.zero_stage if deepspeed else 0,
    }


def _manifest(path: Path) -> dict[str, int]:
    return {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}
