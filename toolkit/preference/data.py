"""Preference pairs to token rows and batches: the prompt and each completion rendered through the chat
template and tokenized apart, cut to data.max_length (prompt from the left first), and batched with
chosen and rejected rows stacked so both go through the model in one forward pass."""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field

import datasets
import numpy as np
import torch

from toolkit.config import DataConfig
from toolkit.data.cache import cache_key, encode_to_cache, tokenizer_fingerprint
from toolkit.data.chat import ensure_chat_template, render
from toolkit.data.mixture import split_sources
from toolkit.data.packing import row_lengths
from toolkit.data.sources import read_source, train_sources
from toolkit.errors import UserError
from toolkit.preference.records import Pair, detect_layout, to_pair
from toolkit.train.loss import IGNORE

logger = logging.getLogger(__name__)
COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
# Bump when the encoding of pairs changes, so rows cached by older code are not reused.
ENCODING_VERSION = 2
CHUNK = 1000


@dataclass
class EncodedPairs:
    columns: dict[str, list[list[int]]] = field(default_factory=lambda: {name: [] for name in COLUMNS})
    truncated: int = 0
    """Pairs longer than the limit, cut to it."""
    dropped: int = 0
    """Pairs left out: after cutting, the two completions were the same tokens."""

    def add(self, prompt: list[int], chosen: list[int], rejected: list[int], max_length: int, keep: int):
        if len(prompt) + max(len(chosen), len(rejected)) > max_length:
            self.truncated += 1
            prompt = prompt[-keep:] if len(prompt) > keep else prompt
            chosen, rejected = chosen[: max_length - len(prompt)], rejected[: max_length - len(prompt)]
        if chosen == rejected:
            self.dropped += 1
            return
        for name, ids in zip(COLUMNS, (prompt, chosen, rejected)):
            self.columns[name].append(ids)


def render_pair(tokenizer, pair: Pair, where: str) -> tuple[str, str, str]:
    """(prompt text ending with the assistant header, chosen completion text, rejected completion text)."""
    prompt = render(tokenizer, pair.prompt, where, generation_prompt=True, tools=pair.tools)
    completions = []
    for turns in (pair.chosen, pair.rejected):
        full = render(tokenizer, pair.prompt + turns, where, tools=pair.tools)
        if not full.startswith(prompt):
            raise UserError(f"{where}: the chat template does not render the answer after the prompt")
        # As in SFT's assistant spans, what a template writes after the end-of-turn text (ChatML's newline)
        # is not part of the answer: scoring it would teach the model that text instead of stopping.
        completions.append(full[len(prompt) :].rstrip())
    return prompt, completions[0], completions[1]


@dataclass
class PairEncoder:
    """Encodes one chunk of records of a source in `layout` into token pairs (see `encode_to_cache`)."""

    layout: str
    tokenizer: object
    max_length: int
    keep_prompt: int

    def __call__(self, chunk) -> tuple[dict[str, list], dict[str, int]]:
        out = EncodedPairs()
        for i, record in enumerate(chunk.records()):
            where = chunk.where(i)
            texts = render_pair(self.tokenizer, to_pair(record, self.layout, where), where)
            # Chat templates write any bos/eos themselves; tokenizing apart keeps the prompt/answer boundary.
            prompt, chosen, rejected = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
            out.add(prompt, chosen, rejected, self.max_length, self.keep_prompt)
        return out.columns, {"truncated": out.truncated, "dropped": out.dropped}


@dataclass
class PairStats:
    train_pairs: dict[str, int]
    eval_pairs: int
    truncated: int
    dropped: int

    def summary(self) -> str:
        sources = ", ".join(f"{name}: {count}" for name, count in self.train_pairs.items())
        return (
            f"data: {sum(self.train_pairs.values())} train pairs ({sources}), {self.eval_pairs} eval, "
            f"{self.truncated} truncated, {self.dropped} dropped"
        )


def build_pairs(
    cfg: DataConfig, tokenizer, keep_prompt: int, seed: int, main_process_first=contextlib.nullcontext
):
    """(train, eval or None, stats): datasets of token pairs, held out and mixed as SFT data is."""
    names = train_sources(cfg)
    if not names:
        raise UserError("data.train: no training source given")
    ensure_chat_template(tokenizer)
    with main_process_first():
        parts = [_prepare(name, cfg, tokenizer, keep_prompt) for name in names]
        held = _prepare(cfg.eval, cfg, tokenizer, keep_prompt) if cfg.eval else None
    held_set = held.dataset if held else None
    rng = np.random.default_rng(seed)
    split = split_sources([p.dataset for p in parts], held_set, cfg.eval_fraction, cfg.weights, rng)
    every = parts + ([held] if held else [])
    stats = PairStats(
        split.per_name(names),
        len(split.eval) if split.eval is not None else 0,
        sum(p.truncated for p in every),
        sum(p.dropped for p in every),
    )
    if stats.truncated:
        logger.warning(
            "%d pairs were longer than data.max_length=%d and cut", stats.truncated, cfg.max_length
        )
    return split.train, split.eval, stats


@dataclass
class _Part:
    dataset: datasets.Dataset
    truncated: int
    dropped: int


def _prepare(name: str, cfg: DataConfig, tokenizer, keep_prompt: int) -> _Part:
    source = read_source(name, cfg.split)
    first = source.first()
    if first is None:
        raise UserError(f"{name}: no records")
    layout = detect_layout(*first)
    key = cache_key("pairs", ENCODING_VERSION, source.identity, cfg.max_length, keep_prompt)
    dataset, counts = encode_to_cache(
        cache_key(key, tokenizer_fingerprint(tokenizer)),
        source.read(CHUNK),
        PairEncoder(layout, tokenizer, cfg.max_length, keep_prompt),
        1,
        desc=f"encoding {name}",
        empty_error=lambda counts: f"{name}: no pair left after cutting to data.max_length={cfg.max_length}",
    )
    return _Part(dataset, counts["truncated"], counts["dropped"])


def pair_lengths(dataset) -> np.ndarray:
    """Width of each pair's rows once stacked: the prompt plus the longer completion (from the Arrow
    offsets alone), what data.group_by_length sorts pairs by."""
    prompt, chosen, rejected = (row_lengths(dataset, name) for name in COLUMNS)
    return prompt + np.maximum(chosen, rejected)


class PairCollator:
    """Pairs to one batch of 2B right-padded rows, the B chosen then the B rejected: input_ids, labels
    (IGNORE on prompt and padding), attention_mask, and `pair_index` (each pair's row in its dataset)."""

    def __init__(self, pad_id: int, multiple: int = 8):
        self.pad_id = pad_id
        self.multiple = multiple

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        sequences = [(r["prompt_ids"], r[side]) for side in ("chosen_ids", "rejected_ids") for r in rows]
        longest = max(len(p) + len(c) for p, c in sequences)
        width = -(-longest // self.multiple) * self.multiple
        input_ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        labels = torch.full_like(input_ids, IGNORE)
        attention_mask = torch.zeros_like(input_ids)
        for i, (prompt, completion) in enumerate(sequences):
            ids = torch.as_tensor(prompt + completion, dtype=torch.long)
            input_ids[i, : len(ids)] = ids
            labels[i, len(prompt) : len(ids)] = ids[len(prompt) :]
            attention_mask[i, : len(ids)] = 1
        batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
        if "pair_index" in rows[0]:
            batch["pair_index"] = torch.tensor([r["pair_index"] for r in rows], dtype=torch.long)
        return batch


def strided_batches(dataset, rank: int, world: int, batch_size: int):
    """This rank's share of `dataset` (pairs rank, rank + world, ...) in batches of rows, padded with
    copies of pair 0 so every rank runs the same number of forward passes (sharded weights need it);
    yields (rows, which of them are real)."""
    per_rank = math.ceil(len(dataset) / world)
    mine = [rank + world * i for i in range(per_rank)]
    for start in range(0, per_rank, batch_size):
        wanted = mine[start : start + batch_size]
        yield [dataset[i if i < len(dataset) else 0] for i in wanted], [i < len(dataset) for i in wanted]
