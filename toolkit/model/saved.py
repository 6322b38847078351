"""What kind of model a saved folder holds, read from its config.json and adapter_config.json alone (no model
code runs): toolkit/model/backbone.py and scalar.py each ask it about their own kind."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def saved_as(path: str | Path, architectures: Callable[[list], bool], peft_task: str) -> bool:
    """Whether the folder at `path` holds a model of one kind: `architectures` accepts the list its config
    names, or it is an adapter peft saved with task type `peft_task`."""
    folder = Path(path).expanduser()
    if architectures(read_json(folder / "config.json").get("architectures") or []):
        return True
    return read_json(folder / "adapter_config.json").get("task_type") == peft_task


def read_json(path: Path) -> dict:
    """The JSON object in `path`; {} when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
