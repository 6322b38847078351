"""A model without its head: the transformer's last hidden states, what an embedding model pools. Loading
(toolkit/model/load.py), export and the merge of an adapter ask here whether a model, a saved folder or
an adapter is one."""

from __future__ import annotations

from pathlib import Path

from toolkit.model.saved import saved_as

PEFT_TASK = "FEATURE_EXTRACTION"
"""peft's task type for such a model (its adapter wraps the bare model's forward)."""


def auto_class():
    from transformers import AutoModel

    return AutoModel


def _bare_names() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    return {
        name
        for names in MODEL_MAPPING_NAMES.values()
        for name in ([names] if isinstance(names, str) else names)
    }


def is_bare(model) -> bool:
    """Whether `model` (peft-wrapped or not) is a bare transformer (transformers' AutoModel class)."""
    own = type(getattr(model, "get_base_model", lambda: model)()).__name__
    return own in _bare_names()


def saved_bare(path: str | Path) -> bool:
    """Whether the folder at `path` holds a bare model: its config's architecture is one, or it is an
    adapter saved for one."""
    return saved_as(path, lambda names: bool(names) and all(n in _bare_names() for n in names), PEFT_TASK)
