"""What a run keeps on disk. This package's own names are the checkpoint format (save.py: write, find,
check, prune); beside it: resume (continue a run), portable (resume under another backend or world size),
safe_load (reading checkpoint files without running code), rundir (the run directory and its lock) and
export (the trained model as Hugging Face files)."""

from toolkit.checkpoint.rundir import CONFIG
from toolkit.checkpoint.save import (
    MARKER,
    RECIPE_STATE,
    SaveSchedule,
    checkpoint_dir,
    damage,
    is_complete,
    latest_checkpoint,
    layout,
    newest_intact,
    prune_checkpoints,
    read_marker,
    read_recipe_state,
    reload_fsdp1_optimizer,
    save_checkpoint,
)

__all__ = [
    "CONFIG",
    "MARKER",
    "RECIPE_STATE",
    "SaveSchedule",
    "checkpoint_dir",
    "damage",
    "is_complete",
    "latest_checkpoint",
    "layout",
    "newest_intact",
    "prune_checkpoints",
    "read_marker",
    "read_recipe_state",
    "reload_fsdp1_optimizer",
    "save_checkpoint",
]
