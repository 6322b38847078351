"""Checkpoints under output_dir/checkpoints/step-<N>: written to a temporary directory by every rank and
renamed into place with a completion marker, so a crash mid-save never leaves a directory that loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from toolkit.errors import UserError

MARKER = "ftkit_checkpoint.json"


def checkpoint_dir(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    root = checkpoint_dir(output_dir)
    done = [p for p in root.glob("step-*") if p.name[5:].isdigit() and is_complete(p)] if root.is_dir() else []
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


def _holds_a_run(output_dir: Path) -> bool:
    return output_dir.is_dir() and any(output_dir.iterdir())


def save_checkpoint(accelerator, output_dir: Path, step: int, state: dict) -> Path:
    """Collective: every rank calls this; returns the finished checkpoint directory."""
    root = checkpoint_dir(output_dir)
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        marker = {**state, "step": step, "files": _manifest(tmp)}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: Path) -> dict:
    """Restore model, optimizer, scheduler and RNG states; return the marker (step and counters)."""
    accelerator.load_state(str(path))
    return json.loads((path / MARKER).read_text())


def _manifest(path: Path) -> dict[str, int]:
    return {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}
