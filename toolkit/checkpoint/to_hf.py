"""`ftkit export`: a training checkpoint of any backend as Hugging Face files (a PEFT adapter or a full
model, safetensors), written on one CPU process from the recipe config saved with the checkpoint. An
embedding run's checkpoint is written as its run's final/ is: the whole model (an adapter merged in and kept
in adapter/) with the files sentence-transformers or a classifier reader needs."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig

from toolkit import data
from toolkit.checkpoint import CONFIG, MARKER, damage, export, portable, read_marker
from toolkit.checkpoint.rundir import MARKER as RUN_MARKER
from toolkit.config import RecipeConfig
from toolkit.embed import export as embed_export
from toolkit.embed import pooling
from toolkit.errors import UserError
from toolkit.model import backbone, quant, scalar, vision
from toolkit.model import load as models
from toolkit.recipes import load_any_recipe_config, recipe_name

EXPORT_MARKER = ".ftkit-export"
"""Left in every export, so that a later export may replace it (and nothing else)."""
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def export_checkpoint(
    checkpoint_dir: Path,
    out_dir: Path,
    merge_lora: bool,
    dtype: str | None,
    base_model: str | None,
    trust_remote_code: bool = False,
) -> str:
    """Write `checkpoint_dir` to `out_dir` and check it; returns a one-line summary.

    `dtype` is bf16 | fp16 | fp32 or None (the run's export.dtype); `base_model` replaces the config's
    model.path, for a checkpoint moved away from where it was trained. Modelling code shipped with the
    base model runs only with `trust_remote_code` (the command line's), whatever the saved config says.
    """
    check_out_dir(out_dir)
    marker = read_marker(checkpoint_dir)
    reason = damage(checkpoint_dir)
    if reason:
        raise UserError(f"{checkpoint_dir}: damaged checkpoint: {reason}")
    # An unknown layout or a refused pickle fails before any model is built.
    portable.check_pickles(checkpoint_dir)
    cfg = run_config(checkpoint_dir)
    cfg.model.trust_remote_code = trust_remote_code
    if base_model:
        cfg.model.path = base_model
    if merge_lora and cfg.model.method == "full":
        raise UserError(f"--merge-lora: {checkpoint_dir} is a full fine-tune; there is no adapter to merge")
    embedder = recipe_name(cfg) == "embed"
    if embedder and cfg.model.method != "full":
        merge_lora = True  # as the run's final/: the whole model that tools load, its adapter kept beside it
    dtype = DTYPE_NAMES[dtype] if dtype else cfg.export.dtype
    skeleton = model_skeleton(cfg)
    shapes = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    packed = (lambda saved: quant.packed_keys(saved, shapes)) if cfg.model.method == "qlora" else None
    weights = dict(portable.read_weights(checkpoint_dir, packed))  # cast and written whole
    cast_weights(weights, skeleton, dtype)
    tokenizer = models.load_tokenizer(cfg.model)
    data.ensure_chat_template(tokenizer)  # as the recipe did before training, so prompts render the same
    if embedder:
        tokenizer.padding_side = "right"  # the last real token sits where pooling and the head look for it
    try:
        count = _write(skeleton, weights, tokenizer, out_dir, merge_lora, dtype, cfg)
    except (OSError, SafetensorError) as exc:
        raise UserError(f"--out: {out_dir} not written: {getattr(exc, 'strerror', None) or exc}") from None
    what = "merged model" if merge_lora else "adapter" if cfg.model.method != "full" else "model"
    if embedder:
        what = {"embedding": "sentence-transformers model", "reranker": "cross-encoder"}.get(
            cfg.embed.task, "sequence classifier"
        )
    return (
        f"exported {what} ({count} tensors) of step {marker['step']} from a "
        f"{portable.describe(marker)} checkpoint to {out_dir}"
    )


def _write(
    skeleton, weights: dict, tokenizer, out_dir: Path, merge_lora: bool, dtype: str, cfg: RecipeConfig
) -> int:
    """Write beside `out_dir`, check, then swap into place; on any failure nothing is left behind."""
    trust_remote_code = cfg.model.trust_remote_code  # the command line's, set by the caller
    tmp = out_dir.with_name(f".{out_dir.name}.export-tmp")
    merged = out_dir.with_name(f".{out_dir.name}.merged-tmp")
    try:
        # A PEFT model saves only its adapter (peft's get_peft_model_state_dict picks those keys).
        skeleton.save_pretrained(str(tmp), state_dict=weights)
        weights.clear()  # one copy of the weights at a time: the merge loads the base again
        tokenizer.save_pretrained(str(tmp))
        vision.copy_processor_files(Path(tokenizer.name_or_path), tmp)
        if cfg.model.adapter and cfg.model.method != "full":
            export.keep_start_adapter(tmp, cfg.model.adapter)
        if merge_lora:
            qlora = cfg.model.method == "qlora"
            export.merge_adapter(tmp, merged, dtype, trust_remote_code, dequantized=qlora)
            if recipe_name(cfg) == "embed":
                tmp.rename(merged / embed_export.ADAPTER)
            else:
                shutil.rmtree(tmp)
            merged.rename(tmp)
        if recipe_name(cfg) == "embed":
            embed_export.describe(tmp, cfg, embed_pooling(cfg))
        count = export.verify_export(tmp, trust_remote_code)
        (tmp / EXPORT_MARKER).write_text("written by ftkit export\n")
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(merged, ignore_errors=True)
    return count


def check_out_dir(out_dir: Path) -> None:
    """Refuse an --out whose files ftkit must not replace: a file, a run or checkpoint (or a directory
    inside or holding one), or a non-empty directory that is not an earlier export."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out: {out_dir} is an existing file; choose a new directory")
    for parent in [out_dir.resolve(), *out_dir.resolve().parents]:
        if _is_run_or_checkpoint(parent):
            raise UserError(f"--out: {out_dir} is or lies inside a training run ({parent}); export elsewhere")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not (out_dir / EXPORT_MARKER).is_file():
            raise UserError(
                f"--out: {out_dir} is a non-empty directory that ftkit export did not write; "
                "choose a new or empty directory"
            )
        held = [p for p in out_dir.rglob("*") if p.is_dir() and _is_run_or_checkpoint(p)]
        if held:
            raise UserError(f"--out: {out_dir} holds a training run ({held[0]}); export elsewhere")


def _is_run_or_checkpoint(path: Path) -> bool:
    # Runs written before run directories were marked are known by their layout.
    old_run = (path / "checkpoints").is_dir() and (path / CONFIG).is_file()
    return (path / RUN_MARKER).is_file() or (path / MARKER).is_file() or old_run


def run_config(checkpoint_dir: Path) -> RecipeConfig:
    """The recipe config saved in the checkpoint, else the one its run saved in output_dir."""
    for path in (checkpoint_dir / CONFIG, checkpoint_dir.parent.parent / CONFIG):
        if path.is_file():
            return _saved_config(path)
    raise UserError(
        f"{checkpoint_dir}: no {CONFIG} in the checkpoint or its run directory, so the base model and "
        "method are unknown"
    )


def _saved_config(path: Path) -> RecipeConfig:
    """Read with the schema of the recipe that wrote it (a preference or GRPO run saves its own section)."""
    return load_any_recipe_config(path)


def model_skeleton(cfg: RecipeConfig) -> torch.nn.Module:
    """The model the run trained, on the meta device: names, shapes and dtypes without any weights."""
    try:
        config = AutoConfig.from_pretrained(
            models.local_path(cfg.model.path), trust_remote_code=cfg.model.trust_remote_code
        )
    except OSError:
        raise UserError(
            f"model.path: cannot read the base model {cfg.model.path} (pass --base-model)"
        ) from None
    except ValueError as exc:
        raise UserError(f"model.path: {cfg.model.path}: {models.remote_code_refusal(exc)}") from None
    dtype = config.dtype if cfg.model.dtype == "auto" else models.DTYPES[cfg.model.dtype]
    scores = head_scores(cfg)
    if scores:  # a reward model, reranker or classifier: pooled at the pad token its run batched with
        config.num_labels, config.pad_token_id = scores, models.load_tokenizer(cfg.model).pad_token_id
    if scores is None:
        auto_class = vision.auto_class(config.model_type)
    else:
        auto_class = scalar.auto_class() if scores else backbone.auto_class()
    with torch.device("meta"):
        model = auto_class.from_config(config, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code)
        parts = cfg.vision if vision.is_vision(config.model_type) else None
        if cfg.model.method != "full":
            from peft import get_peft_model

            model = get_peft_model(model, models.peft_config(cfg.lora, model, parts))
    return model


def head_scores(cfg: RecipeConfig) -> int | None:
    """The scores a row the trained model's head gives: None for a language model's LM head, 0 for an
    embedding model (the bare transformer), 1 for a reward model or a reranker, a classifier's labels."""
    name = recipe_name(cfg)
    if name != "embed":
        return 1 if name == "rm" else None
    return {"embedding": 0, "reranker": 1}.get(cfg.embed.task, len(cfg.embed.labels))


def embed_pooling(cfg) -> str | None:
    """An embedding model's pooling (embed.pooling, or what `auto` finds for the base); None for a head."""
    return pooling.model_pooling(cfg.model, cfg.embed.pooling) if cfg.embed.task == "embedding" else None


def cast_weights(weights: dict[str, torch.Tensor], skeleton: torch.nn.Module, dtype: str) -> None:
    """In place, so one copy exists at a time: `auto` restores each tensor's trained dtype (DeepSpeed
    returns fp32 master weights), any other name casts every floating tensor."""
    trained = {name: tensor.dtype for name, tensor in skeleton.state_dict().items()}
    for name, tensor in weights.items():
        target = trained.get(name, tensor.dtype) if dtype == "auto" else models.DTYPES[dtype]
        if tensor.is_floating_point():
            weights[name] = tensor.to(target)
