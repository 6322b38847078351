"""Training data: files or hub datasets in several layouts, encoded with assistant-only loss masks,
held out and mixed deterministically, and batched with padding."""

from toolkit.data.build import DataStats, build_datasets
from toolkit.data.chat import ensure_chat_template
from toolkit.data.collate import Collator, build_dataloader

__all__ = ["Collator", "DataStats", "build_dataloader", "build_datasets", "ensure_chat_template"]
