"""Where a run starts: a fresh start, or a checkpoint that is intact, safe to read and trained with the
same model and data. A recipe makes one `Resume` and calls it on either side of `accelerator.prepare`:

    resume = Resume.find(output_dir, cfg, say=accelerator.print)
    resume.before_prepare(model, optimizer, scheduler, accelerator)
    model, optimizer, ... = accelerator.prepare(model, optimizer, ...)
    start_step, tokens_seen = resume.after_prepare(accelerator, log, model)
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import yaml
from accelerate.utils.other import load as accelerate_load

from toolkit import checkpoint
from toolkit.checkpoint import moments, portable, rundir, split
from toolkit.distributed import agreed_error
from toolkit.errors import UserError
from toolkit.model import quant
from toolkit.train import metrics, optim
from toolkit.train.nonfinite import nonfinite_message, nonfinite_names
from toolkit.typed_yaml import dotted, to_dict

FIXED = (
    "seed",
    "model.path",
    "model.method",
    "model.dtype",
    "lora.r",
    "lora.alpha",
    "lora.target_modules",
    "lora.use_dora",
    "data",
    "train.global_batch_size",
)
"""Keys (or whole sections) that make a checkpoint another model or another data stream if changed."""
FREE = ("data.num_workers",)
"""Keys inside a FIXED section that only change how the same data is read."""
UNCOMPARED = ("output_dir", "train.resume", "train.overwrite")
"""Keys that say where and how to start, not what is trained."""


class Resume:
    """The checkpoint a run continues from (`checkpoint`, None for a fresh start) and how to load it."""

    def __init__(self, path: Path | None, new_run: bool):
        self.checkpoint = path
        self.new_run = new_run
        """True when output_dir starts empty: a fresh run, or a new run from a checkpoint elsewhere."""
        self.marker = checkpoint.read_marker(path) if path is not None else {}
        self._exact = False
        self._held = None
        self._pending = None
        """(moments or None, layout) still to place after `prepare`, on a portable resume."""

    @classmethod
    def find(cls, output_dir: Path, cfg, say=print, fixed: tuple[str, ...] = FIXED) -> Resume:
        """Choose per `cfg.train.resume`, skipping damaged checkpoints (one `say` line each), refusing a
        checkpoint of another model or data stream (`fixed` keys) and listing other config changes."""
        path, new_run = _choose(output_dir, cfg.train.resume, cfg.train.overwrite, say)
        if path is None:
            return cls(None, new_run=True)
        changes = config_changes(_saved_config(path), to_dict(cfg), fixed)
        if changes:
            step = checkpoint.read_marker(path)["step"]
            say(f"config changed since {path.name}, applied from step {step}: {'; '.join(changes)}")
        portable.check_pickles(path)
        return cls(path, new_run)

    @property
    def next_step(self) -> int:
        """The step this run trains first."""
        return self.marker["step"] + 1 if self.checkpoint is not None else 1

    def recipe_state(self) -> dict:
        """The recipe's own tensors the checkpoint holds ({} for a fresh start or when it saved none)."""
        return checkpoint.read_recipe_state(self.checkpoint) if self.checkpoint is not None else {}

    def before_prepare(self, model, optimizer, scheduler, accelerator) -> None:
        """Remember the objects as built (prepare wraps them in place); from another backend or world
        size, load the checkpoint into them now, while the model is a plain module."""
        self._held = (model, optimizer, scheduler, optim.hyperparameters(optimizer))
        if self.checkpoint is None:
            return
        current = checkpoint.layout(accelerator, model)
        self._exact = portable.resume_plan(self.marker, current) == "exact"
        if self._exact:
            return
        with _naming(self.checkpoint):
            found = portable.restore_portable(self.checkpoint, model, optimizer, scheduler)
            if found is None or not portable.plain_optimizer(current):
                self._pending = (found, current)
                return
            moments.into_plain(model, optimizer, found)
        accelerator.print(portable.carried(self.checkpoint, current, placed=True))

    def after_prepare(self, accelerator, log: metrics.MetricsLog, prepared_model) -> tuple[int, int]:
        """Load what `accelerator.load_state` restores, check the weights, continue the schedule under this
        run's config and the metrics file at the checkpoint's step. Returns (start_step, tokens_seen).

        `prepared_model` is what `accelerator.prepare` returned for the model (FSDP1 wraps a new module)."""
        if self.checkpoint is None:
            return 0, 0
        model, optimizer, scheduler, built = self._held
        step = self.marker["step"]
        if self._pending is not None:
            found, current = self._pending
            with _naming(self.checkpoint):
                placed = found is not None and moments.into_prepared(
                    accelerator, prepared_model, model, optimizer, found
                )
            accelerator.print(portable.carried(self.checkpoint, current, placed))
        if self._exact:
            _warn_random_states(self.checkpoint, accelerator)
            packed = quant.packed_names(model)
            if split.is_split(accelerator):
                split.load_split_state(accelerator, str(self.checkpoint))
            else:
                accelerator.load_state(str(self.checkpoint), **_load_kwargs(accelerator, packed))
            checkpoint.reload_fsdp1_optimizer(self.checkpoint, prepared_model, optimizer)
            bad = nonfinite_names(
                (name, _local(p)) for name, p in model.named_parameters() if name not in packed
            )
            refusal = agreed_error(accelerator, nonfinite_message(self.checkpoint, bad))
            if refusal:
                raise UserError(refusal)
        optim.continue_schedule(optimizer, scheduler, built)
        # accelerate counts micro-batches to know when accumulation syncs, and load_state restores the count
        # of the saving launch: under another accumulation (another world size) it could sync mid-step.
        accelerator.step = step * accelerator.gradient_accumulation_steps
        if accelerator.is_main_process:
            metrics.truncate_after(log.path, step, say=accelerator.print)
        accelerator.print(f"resumed from {self.checkpoint} at step {step}")
        return step, self.marker["tokens_seen"]


def config_changes(saved: dict | None, current: dict, fixed: tuple[str, ...] = FIXED) -> list[str]:
    """`key old -> new` for each changed key; changed `fixed` keys are refused in one line."""
    if saved is None:
        return []
    before, after = dotted(saved), dotted(current)
    changed = [
        key
        for key in sorted(set(before) | set(after))
        if before.get(key) != after.get(key) and key not in UNCOMPARED
    ]
    refused = [key for key in changed if _is_fixed(key, fixed)]
    if refused:
        listed = "; ".join(f"{key} {before.get(key)!r} -> {after.get(key)!r}" for key in refused)
        raise UserError(
            f"train.resume: the checkpoint was trained with another model or data ({listed}); "
            "these cannot change on resume: start a new run in a new output_dir"
        )
    return [f"{key} {before.get(key)!r} -> {after.get(key)!r}" for key in changed]


def _is_fixed(key: str, fixed: tuple[str, ...]) -> bool:
    return key not in FREE and any(key == f or key.startswith(f + ".") for f in fixed)


def _choose(output_dir: Path, resume: str, overwrite: bool, say) -> tuple[Path | None, bool]:
    """(checkpoint or None, whether output_dir starts a new run)."""
    if resume not in ("auto", "never"):
        return _explicit(Path(resume), output_dir, say)
    latest = checkpoint.newest_intact(output_dir, say) if resume == "auto" and not overwrite else None
    if latest is None:
        rundir.check_fresh_start(output_dir, overwrite, resume)
    return latest, latest is None


def _explicit(path: Path, output_dir: Path, say) -> tuple[Path, bool]:
    """A named checkpoint: its own run continues; elsewhere it starts a new run in an empty output_dir,
    or continues the one it started there (the same model and data, relaunched)."""
    reason = checkpoint.damage(path)
    if reason:
        raise UserError(f"train.resume: {path} cannot be loaded: {reason}")
    if path.resolve().parent.parent == output_dir.resolve() or not rundir.holds_results(output_dir):
        return path, not rundir.holds_results(output_dir)
    same_model = _identity(_saved_config(path)) == _identity(_run_config(output_dir))
    if _run_config(output_dir) is None or not same_model:
        raise UserError(
            f"output_dir: {output_dir} holds another run; train.resume={path} starts a new run only in a "
            "new or empty output_dir"
        )
    own = checkpoint.newest_intact(output_dir, say)
    return (own, False) if own is not None else (path, True)


def _saved_config(path: Path) -> dict | None:
    """The recipe config saved in a checkpoint, else in its run directory (older checkpoints)."""
    for file in (path / checkpoint.CONFIG, path.parent.parent / checkpoint.CONFIG):
        if file.is_file():
            return yaml.safe_load(file.read_text())
    return None


def _run_config(output_dir: Path) -> dict | None:
    file = output_dir / checkpoint.CONFIG
    return yaml.safe_load(file.read_text()) if file.is_file() else None


def _identity(config: dict | None) -> dict:
    flat = dotted(config or {})
    return {key: value for key, value in flat.items() if _is_fixed(key, FIXED)}


@contextlib.contextmanager
def _naming(path: Path):
    """A checkpoint that does not fit this run's model is refused in one line that names it."""
    try:
        yield
    except UserError as exc:
        raise UserError(f"train.resume: {path}: {exc}") from None


def _warn_random_states(path: Path, accelerator) -> None:
    """accelerate skips random states it cannot load with a log line at info level; say it instead.

    Read here as accelerate reads them (its `load`: weights only, numpy's state types allowed)."""
    file = path / f"random_states_{accelerator.process_index}.pkl"
    try:
        reason = "" if "torch_manual_seed" in accelerate_load(file) else "no torch generator state in it"
    except FileNotFoundError:
        reason = "no such file (the checkpoint was saved by fewer processes)"
    except Exception as exc:  # whatever accelerate's loader would have swallowed
        reason = str(exc).splitlines()[0]
    if reason:
        print(
            f"warning: rank {accelerator.process_index}: random states not restored from {file}: {reason}; "
            "data order and dropout continue from fresh ones",
            flush=True,
        )


def _load_kwargs(accelerator, packed: set[str]) -> dict:
    """DeepSpeed and accelerate's replicated layout load module state strictly, and a 4-bit base's saved
    quantization state (absmax, maps) has no parameter to go to: those keys are expected there. The
    weights are then checked as usual."""
    if not packed:
        return {}
    return {"load_module_strict": False} if accelerator.distributed_type == "DEEPSPEED" else {"strict": False}


def _local(param):
    """This process's part of a parameter (ZeRO-3 partition, FSDP shard) or the whole of it."""
    if hasattr(param, "ds_tensor"):
        return param.ds_tensor
    return param.to_local() if hasattr(param, "to_local") else param
