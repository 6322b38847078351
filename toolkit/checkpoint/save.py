"""Checkpoints under output_dir/checkpoints/step-<N>: written to a temporary directory by every rank and
renamed into place with a completion marker, so a crash mid-save never leaves a directory that loads.

The marker's manifest holds every file's size and CRC-32, so a file whose bits changed after the save (a
flaky disk, an object store, a network filesystem) is caught before a run trains on it. Before the marker is
written, the main process waits until every file any rank wrote is visible to it at its full size: on a
filesystem shared between machines, another node's writes can show up late."""

from __future__ import annotations

import json
import shutil
import time
import zlib
from pathlib import Path

from accelerate.utils import DistributedType, gather_object
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from toolkit.checkpoint import split
from toolkit.checkpoint.rundir import CONFIG
from toolkit.config import RecipeConfig
from toolkit.distributed import agreed_error
from toolkit.errors import UserError
from toolkit.model import expert_parallel
from toolkit.pipeline import stages
from toolkit.typed_yaml import save_config

MARKER = "ftkit_checkpoint.json"
RECIPE_STATE = "recipe_state.safetensors"
VISIBLE_TIMEOUT_S = 300.0  # how long the main process waits for other nodes' files to appear in full


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


def damage(path: Path) -> str:
    """Why `path` would not load as it was written, or "" when it is intact: its marker's manifest names
    every file, its size and its CRC-32 (a checkpoint of an older ftkit: sizes only); safetensors files must
    also have a readable header."""
    if not is_complete(path):
        return f"no {MARKER} (an unfinished save)"
    try:
        files = json.loads((path / MARKER).read_text()).get("files", {})
    except (OSError, ValueError) as exc:
        return f"{MARKER} is unreadable ({exc})"
    for name, entry in files.items():
        entry = entry if isinstance(entry, dict) else {"size": entry}
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != entry["size"]:
            return f"{name} has {file.stat().st_size} bytes, {entry['size']} were written"
        if file.suffix == ".safetensors" and not _header_readable(file):
            return f"{name} has an unreadable safetensors header"
        if "crc32" in entry and crc32_of(file) != entry["crc32"]:
            return f"{name} does not match its checksum (its bytes changed after the save)"
    return ""


def crc32_of(file: Path) -> str:
    """The file's CRC-32 as 8 hex digits (zlib's, read in 16 MiB pieces: about as fast as the disk)."""
    value = 0
    with file.open("rb") as handle:
        while piece := handle.read(16 << 20):
            value = zlib.crc32(piece, value)
    return f"{value:08x}"


def file_entry(file: Path) -> dict:
    """A file's manifest entry: its size and CRC-32."""
    return {"size": file.stat().st_size, "crc32": crc32_of(file)}


def newest_intact(output_dir: Path, say) -> Path | None:
    """The newest checkpoint that passes `damage`; each damaged newer one is named in one `say` line.
    None when output_dir holds no finished checkpoint; every finished one damaged is an error."""
    root = checkpoint_dir(output_dir)
    done = (
        [p for p in root.glob("step-*") if p.name[5:].isdigit() and is_complete(p)] if root.is_dir() else []
    )
    for path in sorted(done, key=lambda p: int(p.name[5:]), reverse=True):
        reason = damage(path)
        if not reason:
            return path
        say(f"warning: skipping damaged checkpoint {path}: {reason}")
    if done:
        raise UserError(f"{root}: every checkpoint is damaged (see the warnings above); nothing to resume")
    return None


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
    accelerator,
    output_dir: Path,
    step: int,
    state: dict,
    config: RecipeConfig | None = None,
    recipe_tensors: dict | None = None,
) -> Path:
    """Collective: every rank calls this; returns the finished checkpoint directory.

    The marker records `state`, the step and the `layout`; `config` (the run's resolved recipe config) is
    saved beside it, so that export and resume under another backend need nothing but the checkpoint.
    `recipe_tensors` (the same on every rank) are the recipe's own state, written once to RECIPE_STATE.
    A failed write (disk full, permissions) on any rank raises UserError on every rank, removes the
    partial directory and leaves the previous checkpoint as the newest valid one.
    """
    root = checkpoint_dir(output_dir)
    final, tmp = root / f"step-{step}", root / f".step-{step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    if split.is_split(accelerator):
        error = _attempt(lambda: split.save_split_state(accelerator, str(tmp)))
    else:
        error = _attempt(lambda: accelerator.save_state(str(tmp)))
    _agree_or_raise(accelerator, error, tmp, final, output_dir)
    seen = gather_object([_sizes(tmp)])
    if accelerator.is_main_process:
        error = wait_visible(tmp, seen, VISIBLE_TIMEOUT_S)
    _agree_or_raise(accelerator, error if accelerator.is_main_process else "", tmp, final, output_dir)
    if accelerator.is_main_process:
        trained = accelerator._models[0] if accelerator._models else None
        marker = {**state, **layout(accelerator, trained), "step": step}
        if recipe_tensors:
            error = _attempt(lambda: save_file(recipe_tensors, str(tmp / RECIPE_STATE)))
        if not error:
            error = _attempt(lambda: _finalize(tmp, final, marker, config))
    _agree_or_raise(accelerator, error if accelerator.is_main_process else "", tmp, final, output_dir)
    return final


def prune_checkpoints(output_dir: Path, keep_last: int, keep_best: bool) -> list[Path]:
    """Delete all but the `keep_last` newest complete checkpoints (and the best by eval loss); main only.
    The newest is always kept, whatever `keep_last` says."""
    done = sorted(
        (p for p in checkpoint_dir(output_dir).glob("step-*") if is_complete(p)),
        key=lambda p: int(p.name[5:]),
    )
    keep = set(done[-keep_last:]) if keep_last > 0 else set(done)
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
    except (RuntimeError, SafetensorError) as exc:
        # safetensors and torch.save report a full disk or a closed file as these, not as OSError.
        if not _is_write_failure(exc):
            raise
        return str(exc).splitlines()[0]
    return ""


def _is_write_failure(exc: Exception) -> bool:
    text = str(exc).lower()
    return any(word in text for word in ("no space", "basic_ios", "write", "permission", "i/o error"))


def _finalize(tmp: Path, final: Path, marker: dict, config: RecipeConfig | None) -> None:
    if config is not None:
        save_config(config, tmp / CONFIG)
    marker["files"] = _manifest(tmp)
    (tmp / MARKER).write_text(json.dumps(marker, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def _agree_or_raise(accelerator, error: str, tmp: Path, final: Path, output_dir: Path) -> None:
    error = agreed_error(accelerator, error)
    if not error:
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
    raise UserError(f"{final}: checkpoint not written: {error}; {still}")


def reload_fsdp1_optimizer(path: Path, model, optimizer) -> None:
    """Collective, after `accelerator.load_state`: read FSDP1's sharded optimizer state again, by the
    names the checkpoint holds; `model` is the prepared (FSDP-wrapped) one, else nothing happens.

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


def read_recipe_state(path: Path) -> dict:
    """The recipe's own tensors saved with checkpoint `path` ({} when it saved none)."""
    file = path / RECIPE_STATE
    return load_file(str(file)) if file.is_file() else {}


def read_marker(path: Path) -> dict:
    if not is_complete(path):
        raise UserError(f"{path}: not a complete checkpoint (no {MARKER})")
    return json.loads((path / MARKER).read_text())


def layout(accelerator, model) -> dict:
    """How this launch lays out the states it saves (`model`: the trained one, as built or prepared); a
    checkpoint with another layout needs portable.py."""
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    mesh = accelerator.state.device_mesh
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape)) if mesh is not None else {}
    # A pipeline's processes are accelerate's `tp` dimension (toolkit/launch/model_parallel.py).
    pp = sizes.get("tp", 1) if stages.is_part(model) else 1
    return {
        "backend": accelerator.distributed_type.value,
        "world_size": accelerator.num_processes,
        "zero_stage": accelerator.state.deepspeed_plugin.zero_stage if deepspeed else 0,
        "tp_size": sizes.get("tp", 1) if pp == 1 else 1,
        "dp_replicate_size": sizes.get("dp_replicate", 1),
        "pp_size": pp,
        "ep_size": expert_parallel.split_size(model),
    }


def _header_readable(file: Path) -> bool:
    try:
        with safe_open(str(file), framework="pt") as handle:
            handle.keys()
    except Exception:  # safetensors raises its own error types for every kind of bad header
        return False
    return True


def _manifest(path: Path) -> dict[str, dict]:
    return {str(f.relative_to(path)): file_entry(f) for f in sorted(path.rglob("*")) if f.is_file()}


def _sizes(path: Path) -> dict[str, int]:
    return {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}


def wait_visible(path: Path, seen: list[dict[str, int]], timeout_s: float, poll_s: float = 0.5) -> str:
    """ "" once every file in the ranks' listings `seen` (rank by rank) is in `path` at its listed size, as
    this process sees it; else, after `timeout_s`, the first one missing and the rank that wrote it."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [
            (rank, name, size)
            for rank, listing in enumerate(seen)
            for name, size in listing.items()
            if not (path / name).is_file() or (path / name).stat().st_size < size
        ]
        if not missing:
            return ""
        if time.monotonic() >= deadline:
            rank, name, size = missing[0]
            return (
                f"{name} ({size} bytes, seen by rank {rank}) did not reach this node in {timeout_s:g} s; "
                "every node must write checkpoints to one shared filesystem"
            )
        time.sleep(poll_s)
