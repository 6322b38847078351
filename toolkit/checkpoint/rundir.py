"""A run's output_dir: marked as ftkit's when a run creates it, written by one process at a time (a lock held
for the process's life), and cleared only of what ftkit wrote there."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import IO

from toolkit.config import RecipeConfig
from toolkit.distributed import agreed_error
from toolkit.errors import UserError
from toolkit.train.watchdog import STALL_DIR
from toolkit.typed_yaml import save_config

MARKER = ".ftkit-run"
MARKER_TMP = ".ftkit-run.tmp"
LOCK = ".ftkit-run.lock"
CONFIG = "config.yaml"
# The preference recipe's precomputed reference log-probs and what they were computed from.
REFERENCE_LOGPS = ("reference_logps.safetensors", "reference_logps.json")
# Compiled code (checkpoint/compile_cache.py): kept when a fresh run replaces the last, for the same shapes.
COMPILE_CACHE = "compile-cache"
# A generation engine's log and the adapters sent to it (toolkit/engine, GRPO with grpo.generation=vllm).
ENGINE_DIR = "engine"
# `ftkit eval`'s tables: each file it writes there is recorded in MARKER, and only those count as ftkit's.
EVAL_DIR = "eval"
# What a run (and `ftkit plot`) writes at the top of output_dir; trackers' folders are recorded in MARKER.
OUTPUTS = frozenset(
    {MARKER, LOCK, CONFIG, STALL_DIR, "metrics.jsonl", "metrics.png", "checkpoints", "final", "final.tmp"}
    | {"rollouts.jsonl"}  # GRPO's sample rollouts (grpo/samples.py)
    | set(REFERENCE_LOGPS)
    | {COMPILE_CACHE, ENGINE_DIR, MARKER_TMP}
)
CHECKPOINT_NAME = re.compile(r"^(step-\d+|\.step-\d+\.tmp)$")


class RunLock:
    """output_dir's lock as this process holds it (no handle on ranks other than the main one)."""

    def __init__(self, handle: IO | None):
        self._handle = handle

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def claim(accelerator, output_dir: Path) -> RunLock:
    """Collective: the main process takes output_dir's lock; every rank fails alike when it cannot.

    Keep the result for the life of the run: the OS drops the lock with the process, so a crash or
    `kill -9` never leaves a stale one.
    """
    handle, error = None, ""
    if accelerator.is_main_process:
        try:
            handle = hold_lock(output_dir)
        except UserError as exc:
            error = str(exc)
    error = agreed_error(accelerator, error)
    if error:
        raise UserError(error)
    return RunLock(handle)


def hold_lock(output_dir: Path) -> IO:
    """Create output_dir if needed and lock it for this process, or say which process holds it.

    A directory that is neither empty nor a run's (no marker, no checkpoints) is refused first, so that
    not even the lock file is left in it.
    """
    if _entries(output_dir) and not _is_ftkits(output_dir):
        raise _not_ftkits(output_dir)
    make_dir(output_dir)
    path = output_dir / LOCK
    handle = _open_lock(path)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "a process that has not written its name yet"
        handle.close()
        raise UserError(
            f"output_dir: {output_dir} is in use by another run ({holder}); wait for it to end or "
            "choose another output_dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"host {socket.gethostname()} pid {os.getpid()}\n")
    handle.flush()
    return handle


def make_dir(path: Path) -> None:
    """mkdir -p, with one line for a path that is a file, lies under a file, or cannot be written."""
    if path.exists() and not path.is_dir():
        raise UserError(f"output_dir: {path} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"output_dir: {path} lies under a file, not a directory") from None
    except NotADirectoryError:
        raise UserError(f"output_dir: {path} lies under a file, not a directory") from None
    except OSError as exc:
        raise UserError(f"output_dir: cannot create {path}: {exc.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"output_dir: {path} is not writable")


def check_fresh_start(output_dir: Path, overwrite: bool, resume: str) -> None:
    """Refuse, with one line, a fresh run in a directory whose files it must not delete.

    Allowed: a new or empty directory, and one of ftkit's runs that never saved a checkpoint or a model
    (stopped or failed early: it is restarted). A finished or saved run needs `train.overwrite`; a
    directory holding anything ftkit did not write is refused whatever the flags say.
    """
    entries = _entries(output_dir)
    if not entries:
        return
    if not (output_dir / MARKER).is_file():
        raise _not_ftkits(output_dir)
    foreign = foreign_entries(output_dir)
    if foreign:
        raise UserError(
            f"output_dir: {output_dir} holds files ftkit did not write ({', '.join(foreign[:3])}); "
            "move them away or choose another output_dir"
        )
    if holds_results(output_dir) and not overwrite:
        raise UserError(
            f"output_dir: {output_dir} holds another run; set train.overwrite=true to replace it"
            + (" or train.resume=auto to continue it" if resume == "never" else "")
        )


def holds_results(output_dir: Path) -> bool:
    """A saved checkpoint or an exported model: what a restart would lose."""
    checkpoints = output_dir / "checkpoints"
    saved = checkpoints.is_dir() and any(p.name.startswith("step-") for p in checkpoints.iterdir())
    return saved or (output_dir / "final").exists()


def foreign_entries(output_dir: Path) -> list[str]:
    """Names under output_dir that no ftkit run writes (the tracker folders and `ftkit eval` files its
    marker records count)."""
    marker = _marker(output_dir)
    known = OUTPUTS | set(marker.get("tracker_dirs", [])) | {EVAL_DIR}
    foreign = sorted(name for name in _entries(output_dir) if name not in known)
    checkpoints = output_dir / "checkpoints"
    if checkpoints.is_dir():
        foreign += [f"checkpoints/{p.name}" for p in sorted(checkpoints.iterdir()) if not _is_checkpoint(p)]
    elif checkpoints.exists():
        foreign.append("checkpoints")
    return foreign + _foreign_eval(output_dir / EVAL_DIR, set(marker.get("eval_files", [])))


def record_eval(output_dir: Path, names: list[str]) -> None:
    """Add files `ftkit eval` wrote into output_dir/eval/ to the run's marker, so that an overwrite or a
    delete of the run clears them too; a folder without the marker (no run of ftkit's) is left as it is."""
    marker_path = output_dir / MARKER
    if not marker_path.is_file():
        return
    marker = _marker(output_dir)
    marker["eval_files"] = sorted(set(marker.get("eval_files", [])) | set(names))
    tmp = output_dir / MARKER_TMP
    tmp.write_text(json.dumps(marker) + "\n")
    os.replace(tmp, marker_path)


def _foreign_eval(folder: Path, recorded: set[str]) -> list[str]:
    """eval/ counts as ftkit's when it is a real folder of plain files the marker records, else what in it
    is not."""
    if not folder.exists() and not folder.is_symlink():
        return []
    if folder.is_symlink() or not folder.is_dir() or not recorded:
        return [EVAL_DIR]
    return [
        f"{EVAL_DIR}/{p.name}"
        for p in sorted(folder.iterdir())
        if p.name not in recorded or p.is_symlink() or not p.is_file()
    ]


def prepare_output_dir(accelerator, output_dir: Path, cfg: RecipeConfig, fresh: bool) -> None:
    """Collective: a fresh run clears what ftkit wrote before (checked by `check_fresh_start`), marks the
    directory as its own and saves its config."""
    accelerator.wait_for_everyone()  # every rank has looked at output_dir before it changes
    if fresh and accelerator.is_main_process:
        clear_output_dir(output_dir)
        make_dir(output_dir)
        tracker_dirs = [cfg.log.project] if cfg.log.trackers else []
        (output_dir / MARKER).write_text(json.dumps({"tracker_dirs": tracker_dirs}) + "\n")
        save_config(cfg, output_dir / CONFIG)
    accelerator.wait_for_everyone()


def clear_output_dir(output_dir: Path) -> None:
    """Delete ftkit's outputs from output_dir (not the lock this run holds, nor the compile cache); refuse a
    directory holding anything else, or one ftkit did not create."""
    entries = _entries(output_dir)
    if entries and not (output_dir / MARKER).is_file():
        raise UserError(f"output_dir: {output_dir} was not created by ftkit; refusing to clear it")
    foreign = foreign_entries(output_dir)
    if foreign:
        raise UserError(
            f"output_dir: {output_dir} holds files ftkit did not write ({', '.join(foreign[:3])})"
        )
    for name in sorted(entries - {MARKER, COMPILE_CACHE}) + [MARKER] * (MARKER in entries):
        path = output_dir / name
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def _is_ftkits(output_dir: Path) -> bool:
    """Marked by ftkit, or a run of a version that wrote no marker (it has checkpoints to resume)."""
    return (output_dir / MARKER).is_file() or (output_dir / "checkpoints").is_dir()


def _not_ftkits(output_dir: Path) -> UserError:
    return UserError(
        f"output_dir: {output_dir} is not empty and was not created by ftkit (no {MARKER} marker); "
        "choose a new or empty directory"
    )


def _entries(output_dir: Path) -> set[str]:
    if not output_dir.is_dir():
        return set()
    return {p.name for p in output_dir.iterdir()} - {LOCK}


def _is_checkpoint(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and bool(CHECKPOINT_NAME.match(path.name))


def _marker(output_dir: Path) -> dict:
    try:
        marker = json.loads((output_dir / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def _open_lock(path: Path) -> IO:
    try:
        return path.open("a+")
    except OSError as exc:
        raise UserError(f"output_dir: cannot write {path}: {exc.strerror}") from None
