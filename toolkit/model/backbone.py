"""A model without its head: the transformer's last hidden states, what an embedding model pools. Loading
(toolkit/model/load.py), export and the merge of an adapter ask here whether a model, a saved folder or
an adapter is one."""

from __future__ import annotations

import json
from pathlib import Path

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
    folder = Path(path).expanduser()
    names = _read(folder / "config.json").get("architectures") or []
    if names and all(name in _bare_names() for name in names):
        return True
    return _read(folder / "adapter_config.json").get("task_type") == PEFT_TASK


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
