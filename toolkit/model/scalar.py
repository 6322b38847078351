"""A language model with a scalar head: transformers' sequence classification with one label, the shape of
a reward model. Its score is the head on the last real token (transformers pools there by the config's
pad token), so any tool that loads the exported folder scores as training did.

Loading (toolkit/model/load.py), export and `ftkit score` ask here whether a model, a saved folder or an
adapter is one."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from toolkit.model.saved import read_json, saved_as

SUFFIX = "ForSequenceClassification"
PEFT_TASK = "SEQ_CLS"
"""peft's task type for such a model: it saves the head (`score`) whole beside the adapter."""


def auto_class():
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification


def is_scalar(model) -> bool:
    """Whether `model` (peft-wrapped or not) ends in a scalar head."""
    config = getattr(model, "config", None)
    names = getattr(config, "architectures", None) or []
    own = type(getattr(model, "get_base_model", lambda: model)()).__name__
    return own.endswith(SUFFIX) or any(name.endswith(SUFFIX) for name in names)


def saved_scalar(path: str | Path) -> bool:
    """Whether the folder at `path` holds a scalar-head model: its config's architecture says so, or it is
    an adapter saved for one."""
    return saved_as(path, lambda names: any(str(n).endswith(SUFFIX) for n in names), PEFT_TASK)


def peft_task(model) -> str:
    return PEFT_TASK if is_scalar(model) else "CAUSAL_LM"


def seeded_head(model) -> None:
    """Draw the head's weights from the run's seed (as transformers initialises them: normal with the
    config's initializer_range), on every rank alike: transformers initialises a missing head from
    wherever loading left the generator, which differs between a meta-device load and ZeRO-3's."""
    head = model.score.weight
    generator = torch.Generator().manual_seed(torch.initial_seed())
    std = getattr(model.config, "initializer_range", 0.02)
    shape = tuple(getattr(head, "ds_shape", head.shape))
    drawn = torch.randn(shape, generator=generator, dtype=torch.float32) * std
    with _gathered(head), torch.no_grad():
        head.data.copy_(drawn.to(head.dtype))


def _gathered(param):
    """The whole parameter, writable on rank 0 and partitioned again after, under ZeRO-3; else as is."""
    if not hasattr(param, "ds_shape"):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([param], modifier_rank=0)


def head_settings(folder: str | Path) -> dict:
    """What loading a base with the head saved in `folder` needs: its labels (one for a reward model or a
    reranker, several for a classifier), and the pad token the score is pooled by (the saved tokenizer's)."""
    from transformers import AutoTokenizer

    pad = AutoTokenizer.from_pretrained(str(folder)).pad_token_id
    return {"num_labels": saved_labels(folder), "pad_token_id": pad}


def saved_labels(folder: str | Path) -> int:
    """The rows of the head saved in `folder` (an adapter carries it whole): its labels; 1 when unsaid."""
    from safetensors import safe_open

    folder = Path(folder).expanduser()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.endswith("score.weight"):
                    return handle.get_slice(name).get_shape()[0]
    return len(read_json(folder / "config.json").get("id2label") or {}) or 1


def adapter_settings(model, adapter: str | Path) -> dict:
    """from_pretrained's arguments for folding the adapter at `adapter` into `model`: an adapter trained on
    the causal LM (a start adapter) applies to the same layers under a scalar head, loaded as a plain
    adapter (peft's causal-LM wrapper asks the model for generation methods a classifier lacks)."""
    from peft import PeftConfig

    config = PeftConfig.from_pretrained(str(adapter))
    if is_scalar(model) and config.task_type != PEFT_TASK:
        config.task_type = None
        return {"config": config}
    return {}
