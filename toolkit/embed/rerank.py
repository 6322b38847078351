"""Rerankers: a cross-encoder (the model with a one-number head) scores a query and a passage read together.
Rows are a query's candidates with their target scores: one (query, passage, score) record for the pointwise
loss (binary cross-entropy against the score), or a triplet for the listwise loss (softmax cross-entropy of
the positive against its hard negatives). Pairs are tokenized as sentence-transformers' CrossEncoder
tokenizes them: `tokenizer(query, passage)`, cut to data.max_length."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import datasets
import torch
import torch.nn.functional as F

from toolkit.config import DataConfig
from toolkit.data.sources import read_source, train_sources
from toolkit.embed.data import CHUNK, Triplet, mix_rows, read_triplets, to_triplet
from toolkit.errors import UserError

QUERY = ("query", "anchor", "sentence1")
PASSAGE = ("passage", "document", "positive", "sentence2")
SCORE = ("score", "label")


@dataclass
class Candidates:
    query: str
    passages: list[str]
    scores: list[float]
    """Each passage's target: 1 relevant, 0 not (pointwise rows may hold any score in between)."""


def to_scored(record: dict, where: str) -> Candidates:
    """A pointwise record: (query, passage, score); anything else is one line naming the file, line and
    column."""
    for column in record:
        if column not in QUERY + PASSAGE + SCORE:
            raise UserError(
                f"{where}: column {column!r} is not one of query (or anchor, sentence1), passage (or "
                "document, positive, sentence2), score (or label)"
            )
    texts = []
    for names in (QUERY, PASSAGE):
        found = [name for name in names if name in record]
        if len(found) != 1 or not isinstance(record[found[0]], str) or not record[found[0]]:
            raise UserError(f"{where}: needs one non-empty text column of {', '.join(names)}")
        texts.append(record[found[0]])
    found = [name for name in SCORE if name in record]
    if not found:
        raise UserError(
            f"{where}: no score column (score or label): embed.rerank_loss pointwise reads scores"
        )
    score = record[found[0]]
    if isinstance(score, bool) or not isinstance(score, int | float) or not 0 <= score <= 1:
        raise UserError(f"{where}: column {found[0]!r} must be a number from 0 to 1, got {score!r}")
    return Candidates(texts[0], [texts[1]], [float(score)])


def from_triplet(triplet: Triplet) -> Candidates:
    return Candidates(
        triplet.anchor, [triplet.positive, *triplet.negatives], [1.0] + [0.0] * len(triplet.negatives)
    )


def read_candidates(name: str, split: str, listwise: bool) -> list[Candidates]:
    """Every record of source `name`: triplets with at least one negative (listwise), or scored pairs."""
    if listwise:
        rows = [from_triplet(t) for t in read_triplets(name, split)]
        if len(rows[0].passages) < 2:
            raise UserError(f"{name}: embed.rerank_loss listwise needs a hard negative in every row")
        return rows
    rows = [
        to_scored(record, chunk.where(i))
        for chunk in read_source(name, split).read(CHUNK)
        for i, record in enumerate(chunk.records())
    ]
    if not rows:
        raise UserError(f"{name}: no records")
    return rows


def check_first_records(cfg: DataConfig, listwise: bool) -> None:
    """Each source's first record read as the loss reads it, before the run writes anything."""
    for name in [*train_sources(cfg), *([cfg.eval] if cfg.eval else [])]:
        first = read_source(name, cfg.split).first()
        if first is None:
            raise UserError(f"{name}: no records")
        if listwise and not to_triplet(*first).negatives:
            raise UserError(f"{first[1]}: embed.rerank_loss listwise needs a hard negative in every row")
        if not listwise:
            to_scored(*first)


@dataclass
class RerankData:
    train: datasets.Dataset
    eval: list[Candidates] | None
    """Held-out queries, each with its candidate passages (pointwise rows grouped by query)."""

    def summary(self) -> str:
        held = len(self.eval) if self.eval else 0
        return f"data: {len(self.train)} train queries, {held} held-out candidate lists"


def build_rerank_data(
    cfg: DataConfig, tokenizer, listwise: bool, seed: int, main_process_first=contextlib.nullcontext
) -> RerankData:
    """The training rows (held out and mixed as every recipe's are) and the held-out candidate lists."""
    with main_process_first():
        parts = [read_candidates(name, cfg.split, listwise) for name in train_sources(cfg)]
        held = read_candidates(cfg.eval, cfg.split, listwise) if cfg.eval else None
    rows, held = mix_rows(parts, held, cfg, seed)
    pairs = tokenizer(
        [r.query for r in rows for _ in r.passages],
        [p for r in rows for p in r.passages],
        truncation=True,
        max_length=cfg.max_length,
    )["input_ids"]
    width = len(rows[0].passages)
    train = datasets.Dataset.from_dict(
        {
            "pair_ids": [pairs[i * width : (i + 1) * width] for i in range(len(rows))],
            "scores": [r.scores for r in rows],
        }
    )
    return RerankData(train, grouped(held) if held else None)


def grouped(rows: list[Candidates]) -> list[Candidates]:
    """Rows of the same query joined into one candidate list, in first-seen order."""
    by_query: dict[str, Candidates] = {}
    for row in rows:
        into = by_query.setdefault(row.query, Candidates(row.query, [], []))
        into.passages += row.passages
        into.scores += row.scores
    return list(by_query.values())


class CandidateCollator:
    """Rows to one batch of right-padded (query, passage) pairs, a row's candidates together, with `scores`
    (rows x candidates)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        pairs = [ids for r in rows for ids in r["pair_ids"]]
        width = max(len(p) for p in pairs)
        ids = torch.full((len(pairs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(pairs), width), dtype=torch.long)
        for i, pair in enumerate(pairs):
            ids[i, : len(pair)] = torch.tensor(pair, dtype=torch.long)
            mask[i, : len(pair)] = 1
        return {"input_ids": ids, "attention_mask": mask, "scores": torch.tensor([r["scores"] for r in rows])}


def pair_scores(model, batch: dict) -> torch.Tensor:
    """The model's score of each pair in `batch` (float32 at least)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def rerank_terms(model, batch: dict, listwise: bool) -> tuple[torch.Tensor, int, int]:
    """(summed loss, queries whose best-scored candidate is their best target, queries) of a batch."""
    scores = pair_scores(model, batch)
    targets = batch["scores"]
    best = scores.detach().view(targets.shape).argmax(-1) == targets.argmax(-1)
    return rerank_loss(scores, targets, listwise), int(best.sum()), targets.shape[0]


def rerank_loss(scores: torch.Tensor, targets: torch.Tensor, listwise: bool) -> torch.Tensor:
    """Summed over the batch's queries: the listwise softmax cross-entropy of each query's first candidate
    (its positive) against the rest, or the pointwise binary cross-entropy of every pair's score."""
    scores = scores.view(targets.shape)
    if listwise:
        first = torch.zeros(targets.shape[0], dtype=torch.long, device=scores.device)
        return F.cross_entropy(scores, first, reduction="sum")
    return F.binary_cross_entropy_with_logits(scores, targets.to(scores), reduction="sum")
