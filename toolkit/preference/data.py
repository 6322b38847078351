"""Preference pairs to token rows and batches: the prompt and each completion rendered through the chat
template and tokenized apart, cut to data.max_length (prompt from the left first), and batched with
chosen and rejected rows stacked so both go through the model in one forward pass.

For a vision-language model the prompt is encoded through its processor, each image placeholder expanded
into its image's tokens (the completions hold no image: they are tokenized as text), and rows keep their
image references, not pixels: the collator opens a batch's images and gives a pair's chosen and rejected
rows the same pixels. A prompt with images is never cut (see `EncodedPairs.add`)."""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field, replace

import datasets
import numpy as np
import torch

from toolkit.config import DataConfig
from toolkit.data.cache import cache_key, encode_to_cache, tokenizer_fingerprint
from toolkit.data.chat import ensure_chat_template, render
from toolkit.data.collate import Collator
from toolkit.data.images import resolve_image
from toolkit.data.mixture import split_sources
from toolkit.data.packing import row_lengths
from toolkit.data.sources import read_source, train_sources
from toolkit.data.vision_rows import ImageInputs, VisionCollator, as_parts, image_fingerprint, source_folder
from toolkit.errors import UserError
from toolkit.preference.records import Pair, detect_layout, to_pair
from toolkit.train.loss import IGNORE

logger = logging.getLogger(__name__)
COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
# Bump when the encoding of pairs changes, so rows cached by older code are not reused.
ENCODING_VERSION = 3
CHUNK = 1000


@dataclass
class EncodedPairs:
    with_images: bool = False
    """Rows keep their image references in an `images` column (a vision-language model's rows)."""
    columns: dict[str, list] = field(init=False)
    truncated: int = 0
    """Pairs longer than the limit, cut to it."""
    dropped: int = 0
    """Pairs left out: the two completions the same tokens after cutting, or a pair over the limit whose
    prompt holds images and is longer than the tokens a prompt keeps."""

    def __post_init__(self):
        self.columns = {name: [] for name in (*COLUMNS, "margin", *(["images"] if self.with_images else []))}

    def add(
        self,
        prompt: list[int],
        chosen: list[int],
        rejected: list[int],
        max_length: int,
        keep: int,
        images: list[str] | None = None,
        margin: float = 0.0,
    ):
        """Add a pair, cut to `max_length` (the prompt's last `keep` tokens first); `images`: its image
        references, when rows keep them; `margin`: the record's."""
        if len(prompt) + max(len(chosen), len(rejected)) > max_length:
            if images and len(prompt) > keep:
                # A left cut would go through an image or the tokens that frame it (Qwen's vision start
                # decides the image's positions), and the image tokens must match its pixels: the prompt
                # is kept whole or the pair left out.
                self.dropped += 1
                return
            self.truncated += 1
            prompt = prompt[-keep:] if len(prompt) > keep else prompt
            chosen, rejected = chosen[: max_length - len(prompt)], rejected[: max_length - len(prompt)]
        if chosen == rejected:
            self.dropped += 1
            return
        for name, ids in zip(COLUMNS, (prompt, chosen, rejected)):
            self.columns[name].append(ids)
        self.columns["margin"].append(margin)
        if self.with_images:
            self.columns["images"].append(images or [])


def render_pair(tokenizer, pair: Pair, where: str) -> tuple[str, str, str]:
    """(prompt text ending with the assistant header, chosen completion text, rejected completion text)."""
    prompt, chosen = render_answer(tokenizer, pair.prompt, pair.chosen, where, pair.tools)
    return prompt, chosen, render_answer(tokenizer, pair.prompt, pair.rejected, where, pair.tools)[1]


def render_answer(
    tokenizer, prompt: list[dict], answer: list[dict], where: str, tools=None
) -> tuple[str, str]:
    """(prompt text ending with the assistant header, the answer's text after it)."""
    prompt_text = render(tokenizer, prompt, where, generation_prompt=True, tools=tools)
    full = render(tokenizer, prompt + answer, where, tools=tools)
    if not full.startswith(prompt_text):
        raise UserError(f"{where}: the chat template does not render the answer after the prompt")
    # As in SFT's assistant spans, what a template writes after the end-of-turn text (ChatML's newline)
    # is not part of the answer: scoring it would teach the model that text instead of stopping.
    return prompt_text, full[len(prompt_text) :].rstrip()


@dataclass
class PairEncoder:
    """Encodes one chunk of records of a source in `layout` into token pairs (see `encode_to_cache`);
    with `images` (a vision-language model's), rows keep their resolved image references."""

    layout: str
    tokenizer: object
    max_length: int
    keep_prompt: int
    images: ImageInputs | None = None

    def __call__(self, chunk) -> tuple[dict[str, list], dict[str, int]]:
        out = EncodedPairs(with_images=self.images is not None)
        folder = source_folder(chunk.name)
        for i, record in enumerate(chunk.records()):
            where = chunk.where(i)
            pair = to_pair(record, self.layout, where)
            if self.images is None:
                out.add(*self._text_ids(pair, where), self.max_length, self.keep_prompt, margin=pair.margin)
                continue
            refs = [resolve_image(ref, folder, where) for ref in pair.images]
            out.add(
                *self._vision_ids(pair, refs, where), self.max_length, self.keep_prompt, refs, pair.margin
            )
        return out.columns, {"truncated": out.truncated, "dropped": out.dropped}

    def _text_ids(self, pair: Pair, where: str) -> list[list[int]]:
        if pair.images:
            raise UserError(
                f"{where}: this pair has {len(pair.images)} image(s), but model.path is a text-only model; "
                "use a vision-language model or leave the images out"
            )
        texts = render_pair(self.tokenizer, pair, where)
        # Chat templates write any bos/eos themselves; tokenizing apart keeps the prompt/answer boundary.
        return self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]

    def _vision_ids(self, pair: Pair, refs: list[str], where: str) -> list[list[int]]:
        """The prompt's ids with its images expanded; the completions' as text (they hold no image)."""
        sides = {key: as_parts(getattr(pair, key)) for key in ("prompt", "chosen", "rejected")}
        prompt, *completions = render_pair(self.tokenizer, replace(pair, **sides), where)
        expanded = self.images.expanded_ids(prompt, self.images.open(refs, where))
        return [expanded, *self.tokenizer(completions, add_special_tokens=False)["input_ids"]]


@dataclass
class PairStats:
    train_pairs: dict[str, int]
    eval_pairs: int
    truncated: int
    dropped: int
    unit: str = "pairs"
    """What a row of the sets is (KTO's are rows of one completion)."""

    def summary(self) -> str:
        sources = ", ".join(f"{name}: {count}" for name, count in self.train_pairs.items())
        return (
            f"data: {sum(self.train_pairs.values())} train {self.unit} ({sources}), {self.eval_pairs} eval, "
            f"{self.truncated} truncated, {self.dropped} dropped"
        )


def build_pairs(
    cfg: DataConfig,
    tokenizer,
    keep_prompt: int,
    seed: int,
    main_process_first=contextlib.nullcontext,
    images: ImageInputs | None = None,
    encoder=None,
):
    """(train, eval or None, stats): datasets of token pairs, held out and mixed as SFT data is; `images`
    (a vision-language model's) encodes prompts with their images (rows get an `images` column);
    `encoder`: what a chunk of records becomes (PairEncoder's arguments; default PairEncoder)."""
    encoder = encoder or PairEncoder
    names = train_sources(cfg)
    if not names:
        raise UserError("data.train: no training source given")
    ensure_chat_template(tokenizer)
    with main_process_first():
        parts = [_prepare(name, cfg, tokenizer, keep_prompt, images, encoder) for name in names]
        held = _prepare(cfg.eval, cfg, tokenizer, keep_prompt, images, encoder) if cfg.eval else None
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


def _prepare(
    name: str, cfg: DataConfig, tokenizer, keep_prompt: int, images: ImageInputs | None, encoder
) -> _Part:
    source = read_source(name, cfg.split)
    first = source.first()
    if first is None:
        raise UserError(f"{name}: no records")
    layout = detect_layout(*first)
    # Rows keep their images' resolved paths: the same file elsewhere is other rows.
    seen = [image_fingerprint(images), str(source_folder(name))] if images is not None else []
    key = cache_key(encoder.__name__, ENCODING_VERSION, source.identity, cfg.max_length, keep_prompt, *seen)
    dataset, counts = encode_to_cache(
        cache_key(key, tokenizer_fingerprint(tokenizer)),
        source.read(CHUNK),
        encoder(layout, tokenizer, cfg.max_length, keep_prompt, images),
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
    (IGNORE on prompt and padding), attention_mask, `margin` (each pair's, as a float tensor) and
    `pair_index` (each pair's row in its dataset).
    With `images` (a vision-language model's), also the image inputs, each pair's images given to both its
    rows (data.VisionCollator: a batch without any image gets its masked stand-in)."""

    def __init__(self, pad_id: int, images: ImageInputs | None = None, multiple: int = 8):
        self.images = images
        self.rows = Collator(pad_id, multiple) if images is None else VisionCollator(pad_id, images, multiple)

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        stacked = [
            {
                "input_ids": r["prompt_ids"] + r[side],
                "labels": [IGNORE] * len(r["prompt_ids"]) + r[side],
                "images": r.get("images"),
            }
            for side in ("chosen_ids", "rejected_ids")
            for r in rows
        ]
        batch = self.rows(stacked)
        batch["margin"] = torch.tensor([float(r.get("margin", 0.0)) for r in rows])
        if "label" in rows[0]:  # KTO's rows (toolkit/preference/unpaired.py)
            batch["label"] = torch.tensor([bool(r["label"]) for r in rows])
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
