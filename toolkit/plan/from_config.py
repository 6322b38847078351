"""`ftkit plan --config FILE`: the plan's options read from a recipe config, as the recipe reads it (its
schema and checks), so a run is planned as it will be launched. Options given on the command line win."""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import UserError
from toolkit.plan.request import VISION_KEYS
from toolkit.recipes import load_recipe_config, recipe_of

OBJECTIVES = {"sft": "sft", "dpo": "dpo", "grpo": "grpo", "embed": "embed"}
"""The recipes `ftkit plan` plans, by the objective it plans each as."""
GRPO_KEYS = {
    "generations": "num_generations",
    "max_new_tokens": "max_new_tokens",
    "generation_batch": "generation_batch_size",
    "steps_per_generation": "steps_per_generation",
    "gather_for_generation": "gather_for_generation",
    "beta": "beta",
    "generation": "generation",
}
"""The plan's GRPO options and the grpo keys they come from."""


def with_config(options: dict) -> dict:
    """The command line's options over those its --config sets; one of --model and --config is needed."""
    path = options.pop("config", None)
    if path is None:
        if options.get("model") is None:
            raise UserError("ftkit plan needs --model (a model dir, config.json or hub id) or --config FILE")
        return options
    return options_from_config(path) | {k: v for k, v in options.items() if v is not None}


def options_from_config(path: str) -> dict:
    """The `ftkit plan` options a recipe config sets (a config error is one line naming the key)."""
    recipe = recipe_of(path)
    if recipe not in OBJECTIVES:
        raise UserError(f"--config {path}: ftkit plan does not plan the {recipe} recipe yet")
    return options_of(load_recipe_config(recipe, path, []), recipe)


def options_of(cfg, recipe: str) -> dict:
    """The `ftkit plan` options of a loaded config of `recipe` (the studio's new-run page plans with them)."""
    if recipe not in OBJECTIVES:
        raise UserError(f"the {recipe} recipe is not planned yet")
    options = {
        "model": cfg.model.path,
        "method": cfg.model.method,
        "seq_len": cfg.data.max_length,
        "global_batch": cfg.train.global_batch_size,
        "micro_batch": cfg.train.micro_batch_size,
        "lora_r": cfg.lora.r,
        "lora_dropout": cfg.lora.dropout,
        "grad_ckpt": {True: "on", False: "off"}.get(cfg.model.gradient_checkpointing, "auto"),
        "activation_offload": cfg.train.activation_offload,
        "packing": cfg.data.packing or cfg.data.streaming,
        "mixed_precision": "no" if cfg.train.mixed_precision == "no" else "bf16",
        "objective": OBJECTIVES[recipe],
    }
    if recipe != "embed":  # an embedding model has no LM head to chunk
        options |= {"loss_head": cfg.loss.head, "chunk_tokens": cfg.loss.chunk_tokens}
    options |= {key: getattr(cfg.vision, key) for key in VISION_KEYS}
    if cfg.model.dtype in ("float32", "bfloat16"):
        options["dtype"] = cfg.model.dtype
    if recipe == "grpo":
        options |= {name: getattr(cfg.grpo, key) for name, key in GRPO_KEYS.items()}
    if recipe == "embed":
        options |= _embed_options(cfg)
    return options


def _embed_options(cfg) -> dict:
    """The embedding section's options; the hard negatives a row from the first training record when the
    source is a local file (else --negatives tells)."""
    task = cfg.embed.task
    options = {"embed_task": task}
    if task == "embedding":
        options["cached"] = cfg.embed.cached
        options["matryoshka_dims"] = tuple(cfg.embed.matryoshka_dims)
    if task == "classifier":
        options["labels"] = len(cfg.embed.labels)
    listwise = task == "embedding" or (task == "reranker" and cfg.embed.rerank_loss == "listwise")
    negatives = first_row_negatives(cfg.data) if listwise else None
    if negatives is not None:
        options["negatives"] = negatives
    return options


def first_row_negatives(data) -> int | None:
    """Hard negatives of the first record of the first training source, when that source is a local file
    (None: a hub data set, which the plan does not download)."""
    from toolkit.data.sources import read_source, train_sources
    from toolkit.embed.data import to_triplet

    name = train_sources(data)[0]
    if not Path(name).expanduser().is_file():
        return None
    for chunk in read_source(name, data.split).read(1):
        return len(to_triplet(chunk.records()[0], chunk.where(0)).negatives)
    return None
