"""Embedding data in sentence-transformers' triplet layout, from JSONL, JSON, parquet, CSV or a hub
dataset: an anchor (the query), its positive passage and any number of hard negatives, one column each
(`negative`, or `negative_1`, `negative_2`, ...; or a `negatives` list). Texts are tokenized as the
exported model's tokenizer will (`tokenizer(text)`, cut to data.max_length), the query prefix before each
anchor; batches hold three right-padded groups of rows: anchors, positives, negatives."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import datasets
import numpy as np
import torch

from toolkit.config import DataConfig
from toolkit.data.mixture import split_sources
from toolkit.data.sources import read_source, train_sources
from toolkit.errors import UserError

ANCHOR = ("anchor", "query")
POSITIVE = ("positive", "passage", "document")
NEGATIVE = re.compile(r"negative(_\d+)?$")
CHUNK = 1000


@dataclass
class Triplet:
    anchor: str
    positive: str
    negatives: list[str]


def to_triplet(record: dict, where: str) -> Triplet:
    """A record as (anchor, positive, negatives); a column the layout has no place for, or a missing or
    non-text one, is one line naming the file, the line and the column."""
    for column in record:
        if column not in ANCHOR + POSITIVE + ("negatives",) and not NEGATIVE.match(column):
            raise UserError(
                f"{where}: column {column!r} is not one of anchor (or query), positive (or passage, "
                "document), negative, negative_N, negatives"
            )
    anchor = _text(record, ANCHOR, where)
    positive = _text(record, POSITIVE, where)
    negatives = [record[c] for c in sorted(record, key=_negative_order) if NEGATIVE.match(c)]
    negatives += record.get("negatives") or []
    for text in negatives:
        if not isinstance(text, str) or not text:
            raise UserError(f"{where}: column 'negative': every negative must be a non-empty text")
    return Triplet(anchor, positive, negatives)


def _text(record: dict, names: tuple[str, ...], where: str) -> str:
    found = [name for name in names if name in record]
    if len(found) != 1:
        what = "no" if not found else "more than one"
        raise UserError(f"{where}: {what} {names[0]} column (one of {', '.join(names)})")
    text = record[found[0]]
    if not isinstance(text, str) or not text:
        raise UserError(f"{where}: column {found[0]!r} must be a non-empty text, got {text!r}")
    return text


def _negative_order(column: str) -> int:
    match = NEGATIVE.match(column)
    return int(match.group(1)[1:]) if match and match.group(1) else 0


def read_triplets(name: str, split: str) -> list[Triplet]:
    """Every record of source `name`, checked; each row must hold as many negatives as the first."""
    triplets = []
    for chunk in read_source(name, split).read(CHUNK):
        for i, record in enumerate(chunk.records()):
            triplet = to_triplet(record, chunk.where(i))
            if triplets and len(triplet.negatives) != len(triplets[0].negatives):
                raise UserError(
                    f"{chunk.where(i)}: {len(triplet.negatives)} negatives where the first record has "
                    f"{len(triplets[0].negatives)}; give every row the same number"
                )
            triplets.append(triplet)
    if not triplets:
        raise UserError(f"{name}: no records")
    return triplets


def check_sources(cfg: DataConfig, sample: int) -> str:
    """The opening `sample` records of each training and held-out source read as triplets (what
    `ftkit check-config` reports; a mistake is one line naming the file, line and column)."""
    widths = set()
    for name in [*train_sources(cfg), *([cfg.eval] if cfg.eval else [])]:
        for chunk in read_source(name, cfg.split).read(sample):
            records = chunk.records()
            widths |= {len(to_triplet(record, chunk.where(i)).negatives) for i, record in enumerate(records)}
            break
    counts = ", ".join(str(w) for w in sorted(widths))
    opening = f"the opening {sample} records of each source read"
    return f"embedding triplets: {opening} ({counts} hard negatives a row)"


def encode_triplets(triplets: list[Triplet], tokenizer, max_length: int, prefix: str) -> datasets.Dataset:
    """Token ids of each row's anchor (after `prefix`), positive and negatives."""

    def ids(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, truncation=True, max_length=max_length)["input_ids"] if texts else []

    width = len(triplets[0].negatives)
    negatives = ids([text for t in triplets for text in t.negatives])
    return datasets.Dataset.from_dict(
        {
            "anchor_ids": ids([prefix + t.anchor for t in triplets]),
            "positive_ids": ids([t.positive for t in triplets]),
            "negative_ids": [negatives[i * width : (i + 1) * width] for i in range(len(triplets))],
        }
    )


@dataclass
class EmbedData:
    train: datasets.Dataset
    eval: list[Triplet] | None
    """The held-out rows as text: their anchors are queried against every positive and negative."""
    negatives: int
    """Hard negatives per row."""

    def summary(self) -> str:
        held = len(self.eval) if self.eval else 0
        return (
            f"data: {len(self.train)} train triplets ({self.negatives} hard negatives each), {held} held out"
        )


def mix_rows(parts: list[list], held: list | None, cfg: DataConfig, seed: int) -> tuple[list, list | None]:
    """The rows of every train source, mixed by data.weights (the shared mixture), and the held-out rows:
    `held` when an eval source was read, else data.eval_fraction of the sources' rows held out."""
    pool = [row for part in parts for row in part]
    starts = np.cumsum([0] + [len(part) for part in parts])
    index = [
        datasets.Dataset.from_dict({"row": list(range(start, start + len(part)))})
        for start, part in zip(starts, parts, strict=False)
    ]
    rng = np.random.default_rng(seed)
    split = split_sources(index, None, 0.0 if held else cfg.eval_fraction, cfg.weights, rng)
    if held is None and split.eval is not None:
        held = [pool[i] for i in split.eval["row"]]
    return [pool[i] for i in split.train_rows], held


def build_embed_data(
    cfg: DataConfig, tokenizer, prefix: str, seed: int, main_process_first=contextlib.nullcontext
) -> EmbedData:
    """The training rows (held out and mixed as every recipe's are) and the held-out rows as text."""
    names = train_sources(cfg)
    with main_process_first():
        parts = [read_triplets(name, cfg.split) for name in names]
        held = read_triplets(cfg.eval, cfg.split) if cfg.eval else None
    widths = {len(part[0].negatives) for part in parts + ([held] if held else [])}
    if len(widths) > 1:
        raise UserError(f"data: the sources hold different numbers of negatives per row ({sorted(widths)})")
    train, held = mix_rows(parts, held, cfg, seed)
    return EmbedData(encode_triplets(train, tokenizer, cfg.max_length, prefix), held, widths.pop())


class TripletCollator:
    """Rows to one batch of texts for a single forward pass: the B anchors, then the B positives, then each
    row's negatives row after row, right-padded together (input_ids, attention_mask)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        texts = [r["anchor_ids"] for r in rows] + [r["positive_ids"] for r in rows]
        texts += [ids for r in rows for ids in r["negative_ids"]]
        width = max(len(t) for t in texts)
        ids = torch.full((len(texts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(texts), width), dtype=torch.long)
        for i, row in enumerate(texts):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        return {"input_ids": ids, "attention_mask": mask}


def groups(vectors: torch.Tensor, negatives: int) -> dict[str, torch.Tensor]:
    """A batch's vectors (or their gradients) by group: anchor, positive and, with hard negatives,
    negative (`negatives` per row)."""
    rows = vectors.shape[0] // (2 + negatives)
    split = {"anchor": vectors[:rows], "positive": vectors[rows : 2 * rows]}
    if negatives:
        split["negative"] = vectors[2 * rows :]
    return split


def batch_rows(batch: dict, negatives: int) -> int:
    """Queries (anchors) in `batch`."""
    return batch["input_ids"].shape[0] // (2 + negatives)
