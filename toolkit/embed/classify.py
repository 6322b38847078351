"""Sequence classifiers (intent, guard, sentiment): the model with a head of one number per declared label
(`embed.labels`), trained with cross-entropy on (text, label) rows; accuracy and F1 per label held out."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import datasets
import torch

from toolkit.config import DataConfig
from toolkit.data.sources import read_source, train_sources
from toolkit.embed.data import CHUNK, mix_rows
from toolkit.errors import UserError

TEXT = ("text", "sentence")


@dataclass
class Labelled:
    text: str
    label: int
    """Its index in embed.labels."""


def to_labelled(record: dict, labels: list[str], where: str) -> Labelled:
    """A (text, label) record; another column, a missing text or a label outside `labels` is one line
    naming the file, the line and the column."""
    for column in record:
        if column not in (*TEXT, "label"):
            raise UserError(f"{where}: column {column!r} is not one of text (or sentence), label")
    found = [name for name in TEXT if name in record]
    if len(found) != 1 or not isinstance(record[found[0]], str) or not record[found[0]]:
        raise UserError(f"{where}: needs one non-empty text column of text, sentence")
    label = record.get("label")
    if label not in labels:
        raise UserError(f"{where}: column 'label': {label!r} is not one of embed.labels {labels}")
    return Labelled(record[found[0]], labels.index(label))


def read_labelled(name: str, split: str, labels: list[str]) -> list[Labelled]:
    rows = [
        to_labelled(record, labels, chunk.where(i))
        for chunk in read_source(name, split).read(CHUNK)
        for i, record in enumerate(chunk.records())
    ]
    if not rows:
        raise UserError(f"{name}: no records")
    return rows


def check_labels(cfg: DataConfig, labels: list[str]) -> None:
    """Every record of every source read (each label checked), before the run writes anything."""
    for name in [*train_sources(cfg), *([cfg.eval] if cfg.eval else [])]:
        read_labelled(name, cfg.split, labels)


@dataclass
class LabelledData:
    train: datasets.Dataset
    eval: list[Labelled] | None

    def summary(self) -> str:
        return f"data: {len(self.train)} train texts, {len(self.eval) if self.eval else 0} held out"


def build_labelled_data(
    cfg: DataConfig, tokenizer, labels: list[str], seed: int, main_process_first=contextlib.nullcontext
) -> LabelledData:
    """The training rows (held out and mixed as every recipe's are) and the held-out rows."""
    with main_process_first():
        parts = [read_labelled(name, cfg.split, labels) for name in train_sources(cfg)]
        held = read_labelled(cfg.eval, cfg.split, labels) if cfg.eval else None
    rows, held = mix_rows(parts, held, cfg, seed)
    ids = tokenizer([r.text for r in rows], truncation=True, max_length=cfg.max_length)["input_ids"]
    return LabelledData(
        datasets.Dataset.from_dict({"input_ids": ids, "label": [r.label for r in rows]}), held
    )


class LabelCollator:
    """Rows to right-padded input_ids and attention_mask with each row's `label`."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row["input_ids"])] = torch.tensor(row["input_ids"], dtype=torch.long)
            mask[i, : len(row["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "label": torch.tensor([r["label"] for r in rows])}


def class_logits(model, batch: dict) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def class_terms(model, batch: dict) -> tuple[torch.Tensor, int, int]:
    """(summed cross-entropy, rows predicted right, rows) of a batch."""
    logits = class_logits(model, batch)
    summed = torch.nn.functional.cross_entropy(logits, batch["label"], reduction="sum")
    return summed, int((logits.detach().argmax(-1) == batch["label"]).sum()), batch["label"].shape[0]


def class_metrics(predicted: list[int], gold: list[int], labels: list[str], prefix: str = "") -> dict:
    """Accuracy, macro F1 and each label's F1 (`f1/<label>`; 0 for a label neither predicted nor present)."""
    metrics = {f"{prefix}accuracy": sum(p == g for p, g in zip(predicted, gold, strict=True)) / len(gold)}
    scores = []
    for index, label in enumerate(labels):
        hits = sum(p == g == index for p, g in zip(predicted, gold, strict=True))
        claimed, present = predicted.count(index), gold.count(index)
        f1 = 2 * hits / (claimed + present) if claimed + present else 0.0
        metrics[f"{prefix}f1/{label}"] = f1
        scores.append(f1)
    return {**metrics, f"{prefix}macro_f1": sum(scores) / len(scores)}
