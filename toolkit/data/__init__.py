"""Training data: files or hub datasets in several layouts, encoded with assistant-only loss masks,
held out and mixed deterministically, optionally packed, and batched with padding."""

from toolkit.data.build import DataStats, build_datasets
from toolkit.data.chat import ensure_chat_template
from toolkit.data.collate import Collator, PackedCollator, count_rows, count_tokens, model_inputs, real_tokens
from toolkit.data.encode import IGNORE
from toolkit.data.loader import RankShard, eval_loader, train_loader
from toolkit.data.packing import LengthGroupedSampler, row_lengths
from toolkit.data.vision_rows import ImageInputs, VisionCollator

__all__ = [
    "IGNORE",
    "ImageInputs",
    "Collator",
    "DataStats",
    "LengthGroupedSampler",
    "PackedCollator",
    "RankShard",
    "VisionCollator",
    "build_datasets",
    "count_rows",
    "count_tokens",
    "ensure_chat_template",
    "eval_loader",
    "model_inputs",
    "real_tokens",
    "row_lengths",
    "train_loader",
]
