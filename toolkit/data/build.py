"""From the data config to the train and eval datasets: read, encode (cached), hold out, mix."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from toolkit.config import DataConfig
from toolkit.data.agreement import first_disagreement
from toolkit.data.cache import cache_key, encode_to_cache, tokenizer_fingerprint
from toolkit.data.chat import ensure_chat_template
from toolkit.data.encode import IGNORE, ChunkEncoder, check_encoder
from toolkit.data.formats import detect_format
from toolkit.data.mixture import Split, split_sources
from toolkit.data.packing import pack_dataset
from toolkit.data.parallel import default_num_proc
from toolkit.data.sources import read_source, train_sources
from toolkit.data.streaming import StreamRows
from toolkit.data.vision_rows import ImageInputs, VisionEncoder, image_fingerprint, source_folder
from toolkit.errors import UserError

logger = logging.getLogger(__name__)

# Records per encoded chunk: large enough that the Rust tokenizer batches well, small enough to hold a few.
CHUNK = 1000
# Records per chunk when streaming: each process reads every world-size-th chunk, so smaller chunks let
# a small corpus still feed every process.
STREAM_CHUNK = 256


@dataclass
class DataStats:
    train_examples: dict[str, int]
    """Rows each training source contributes to the training set (after the eval hold-out and mixing)."""
    eval_examples: int
    """Rows in the eval set (0 when there is none)."""
    truncated: int
    """Examples, over all sources read, longer than data.max_length and cut to it."""
    dropped: int
    """Examples, over all sources read, left out because no token of theirs is trained."""
    label_tokens: int
    """Trained (label) tokens in the training set."""
    packed_rows: int = 0
    """Rows the training examples were packed into (0 without data.packing)."""
    packing_efficiency: float = 0.0
    """Real tokens over the packed rows' capacity (rows x data.max_length)."""
    streaming: bool = False
    """Training rows are read, encoded and packed as training goes (data.streaming): counts unknown."""

    def summary(self) -> str:
        if self.streaming:
            return (
                f"data: streaming {', '.join(self.train_examples)} (read, encoded and packed into rows as "
                f"training goes; no totals ahead), {self.eval_examples} eval"
            )
        sources = ", ".join(f"{name}: {count}" for name, count in self.train_examples.items())
        total = sum(self.train_examples.values())
        packed = ""
        if self.packed_rows:
            packed = f", packed into {self.packed_rows} rows ({self.packing_efficiency:.1%} full)"
        return (
            f"data: {total} train examples ({sources}){packed}, {self.eval_examples} eval, "
            f"{self.label_tokens:,} trained tokens, {self.truncated} truncated, {self.dropped} dropped"
        )


@dataclass
class _Part:
    dataset: datasets.Dataset
    truncated: int
    dropped: int
    trained: np.ndarray
    """Trained tokens per row."""


def build_datasets(
    cfg: DataConfig,
    tokenizer,
    seed: int,
    main_process_first=contextlib.nullcontext,
    images: ImageInputs | None = None,
) -> tuple[datasets.Dataset, datasets.Dataset | None, DataStats]:
    """(train, eval or None, stats): rows with `input_ids` and `labels`, identical for the same config,
    data, tokenizer and seed. `main_process_first` (e.g. `accelerator.main_process_first`) lets the main
    process encode while the other ranks wait and then load its cached result. `images` (a
    vision-language model's processor) encodes rows with their images (and an `images` column)."""
    names = train_sources(cfg)
    if not names:
        raise UserError("data.train: no training source given")
    if images is not None:
        _check_vision_settings(cfg)
    if cfg.streaming:
        return _streaming(names, cfg, tokenizer, main_process_first)
    with main_process_first():
        parts = [_prepare(name, cfg, tokenizer, images) for name in names]
        held = _prepare(cfg.eval, cfg, tokenizer, images) if cfg.eval else None
    rng = np.random.default_rng(seed)
    held_set = held.dataset if held else None
    split = split_sources([p.dataset for p in parts], held_set, cfg.eval_fraction, cfg.weights, rng)
    train, eval_set = split.train, split.eval
    stats = _stats(names, parts, held, split)
    if cfg.packing:
        train, stats.packing_efficiency = pack_dataset(train, cfg.max_length, rng)
        stats.packed_rows = len(train)
    if stats.truncated:
        logger.warning(
            "%d examples were longer than data.max_length=%d tokens and were truncated",
            stats.truncated,
            cfg.max_length,
        )
    if stats.dropped:
        logger.warning(
            "%d examples had no trained token (empty, no assistant turn, or cut off by "
            "data.max_length) and were left out",
            stats.dropped,
        )
    return train, eval_set, stats


def _check_vision_settings(cfg: DataConfig) -> None:
    """What image rows cannot do yet, refused in one line rather than mixed silently."""
    if cfg.packing:
        raise UserError(
            "data.packing: rows with images are not packed (their image positions would cross rows); "
            "set data.packing: false"
        )
    if cfg.streaming:
        raise UserError("data.streaming: rows with images are read whole; set data.streaming: false")


def _streaming(names: list[str], cfg: DataConfig, tokenizer, main_process_first):
    """(stream of packed training rows, eval set from data.eval or None, stats without totals)."""
    if cfg.weights is not None:
        raise UserError("data.weights: mixtures need the whole data up front; not with data.streaming")
    sources, identities = [], []
    for name in names:
        source = read_source(name, cfg.split, streaming=True)
        encoder = _encoder(data_format(source, cfg, tokenizer), cfg, tokenizer)
        sources.append((source, encoder))
        identities.append((source.identity, encoder.fmt))
    key = cache_key(identities, cfg.max_length, _masking(cfg), tokenizer_fingerprint(tokenizer), CHUNK)
    held = None
    if cfg.eval:
        with main_process_first():
            held = _prepare(cfg.eval, cfg, tokenizer)
    eval_set = held.dataset if held else None
    stats = DataStats(
        train_examples={name: 0 for name in names},
        eval_examples=len(eval_set) if eval_set is not None else 0,
        truncated=held.truncated if held else 0,
        dropped=held.dropped if held else 0,
        label_tokens=0,
        streaming=True,
    )
    return StreamRows(sources, STREAM_CHUNK, cfg.max_length, key), eval_set, stats


def data_format(source, cfg: DataConfig, tokenizer, images: bool = False) -> str:
    """The source's record layout (detected from its first record with data.format auto), checked to be
    encodable with this tokenizer (`images`: by a vision-language model)."""
    first = source.first()
    if first is None:
        raise UserError(f"{source.name}: no records")
    fmt = detect_format(*first) if cfg.format == "auto" else cfg.format
    if fmt != "text":
        ensure_chat_template(tokenizer)
    check_encoder(tokenizer, fmt, cfg.assistant_only_loss)
    found = first_disagreement(tokenizer, source, fmt, images)
    if found:
        logger.warning("%s", found)
    return fmt


def _encoder(fmt: str, cfg: DataConfig, tokenizer, images: ImageInputs | None = None) -> ChunkEncoder:
    if images is not None:
        return VisionEncoder(
            fmt, tokenizer, cfg.max_length, cfg.assistant_only_loss, cfg.train_reasoning, images
        )
    return ChunkEncoder(fmt, tokenizer, cfg.max_length, cfg.assistant_only_loss, cfg.train_reasoning)


def _masking(cfg: DataConfig) -> list:
    """The settings that decide which tokens are trained (part of the cache key)."""
    return [cfg.assistant_only_loss, cfg.train_reasoning]


def _stats(names: list[str], parts: list[_Part], held: _Part | None, split: Split) -> DataStats:
    everything = parts + ([held] if held else [])
    return DataStats(
        train_examples=split.per_name(names),
        eval_examples=len(split.eval) if split.eval is not None else 0,
        truncated=sum(p.truncated for p in everything),
        dropped=sum(p.dropped for p in everything),
        label_tokens=int(np.concatenate([p.trained for p in parts])[split.train_rows].sum()),
    )


def _prepare(name: str, cfg: DataConfig, tokenizer, images: ImageInputs | None = None) -> _Part:
    """One source read, checked and encoded chunk by chunk, from the cache when this exact work was done
    before."""
    source = read_source(name, cfg.split)
    fmt = data_format(source, cfg, tokenizer, images is not None)
    key = cache_key(
        source.identity,
        fmt,
        cfg.max_length,
        _masking(cfg),
        tokenizer_fingerprint(tokenizer),
        # Rows keep their images' resolved paths: the same file elsewhere is other rows.
        *([image_fingerprint(images), str(source_folder(name))] if images is not None else []),
    )
    dataset, counts = encode_to_cache(
        key,
        source.read(CHUNK),
        _encoder(fmt, cfg, tokenizer, images),
        cfg.num_proc or default_num_proc(),
        desc=f"encoding {name}",
        empty_error=lambda counts: (
            f"{name}: none of its {counts['dropped']} examples has a trained token left (no assistant "
            f"turn, or cut off by data.max_length={cfg.max_length}; try a larger one)"
        ),
    )
    return _Part(dataset, counts["truncated"], counts["dropped"], _trained_per_row(dataset))


def _trained_per_row(dataset: datasets.Dataset) -> np.ndarray:
    """Trained tokens of each row of a freshly cached `dataset`, read one record batch at a time with
    plain reads: reading the labels through the memory map would leave every page of them resident, and
    counted in this process's RSS, for the rest of the run."""
    counts = []
    for cached in dataset.cache_files:
        with pa.OSFile(cached["filename"]) as handle:
            counts += [_trained(batch.column("labels")) for batch in pa.ipc.open_stream(handle)]
    return np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)


def _trained(labels) -> np.ndarray:
    flat = pc.list_flatten(labels).to_numpy()
    rows = pc.list_parent_indices(labels).to_numpy()
    return np.bincount(rows[flat != IGNORE], minlength=len(labels))
