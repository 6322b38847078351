"""A disk cache of encoded sources: under `main_process_first` the main process encodes and saves, and
the other ranks (and later runs with the same data, tokenizer and settings) load its result. Rows are
encoded chunk by chunk (on several processes with `num_proc`) and appended to the Arrow file as they come,
so memory holds a few chunks, never the whole source."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import datasets
import pyarrow as pa
from tqdm.auto import tqdm

from toolkit.data.parallel import ordered_map
from toolkit.errors import UserError

TOKENS = pa.list_(pa.int32())
COLUMN_TYPES = {"images": pa.list_(pa.string()), "margin": pa.float64(), "label": pa.bool_()}
"""Columns that are not token ids: a row's image references, a preference pair's margin, a KTO row's flag."""
# Bump when encoding changes, so rows cached by older code are not reused.
CACHE_VERSION = 2


def cache_root() -> Path:
    return Path(datasets.config.HF_DATASETS_CACHE) / "ftkit"


def cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps([CACHE_VERSION, *parts], default=str).encode()).hexdigest()[:32]


def tokenizer_fingerprint(tokenizer) -> str:
    """Everything about the tokenizer that changes encoded rows; a sample encoding catches the rest
    (normalisation, added bos/eos)."""
    return cache_key(
        type(tokenizer).__name__,
        sorted(tokenizer.get_vocab().items()),
        tokenizer.chat_template,
        tokenizer.special_tokens_map,
        tokenizer("Hello world, 123!")["input_ids"],
    )


def encode_to_cache(
    key: str, chunks: Iterable, encode: Callable, num_proc: int, desc: str, empty_error: Callable[[dict], str]
) -> tuple[datasets.Dataset, dict]:
    """(rows, counts) of cache entry `key`, built first when missing: `encode(chunk)` returns (columns of
    int lists, counts) for each chunk of records, and the entry holds every chunk's rows in order and
    the summed counts (plus `rows`). `encode` must be picklable for num_proc > 1. A source with no row
    left is the UserError `empty_error(counts)`, and nothing is cached."""
    path = cache_root() / key
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written beside the entry and renamed into place, so a reader never sees half an entry.
        staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{key}.partial-"))
        try:
            batches = ordered_map(ArrowBatches(encode), chunks, num_proc)
            counts = _write_rows(staging / "rows.arrow", batches, desc)
            if not counts.get("rows"):
                raise UserError(empty_error(counts))
            (staging / "counts.json").write_text(json.dumps(counts))
            staging.rename(path)
        except OSError:
            if not path.is_dir():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone after the rename; leftovers after a failure
    rows = datasets.Dataset.from_file(str(path / "rows.arrow"))
    return rows, json.loads((path / "counts.json").read_text())


class ArrowBatches:
    """`encode` with its columns turned into an Arrow record batch where it runs: a worker process then
    sends back a few buffers rather than pickled lists of Python ints."""

    def __init__(self, encode: Callable):
        self.encode = encode

    def __call__(self, chunk) -> tuple[pa.RecordBatch, dict]:
        columns, counts = self.encode(chunk)
        arrays = {
            name: pa.array(values, type=COLUMN_TYPES.get(name, TOKENS)) for name, values in columns.items()
        }
        return pa.record_batch(arrays), counts


def _write_rows(path: Path, results: Iterable[tuple[pa.RecordBatch, dict]], desc: str) -> dict:
    """An Arrow stream file (the layout `datasets` memory-maps), one record batch per chunk; returns the
    summed counts plus `rows`. The progress bar appears only when writing takes more than a few seconds."""
    counts: dict[str, int] = {"rows": 0}
    writer = None
    with pa.OSFile(str(path), "wb") as sink, tqdm(desc=desc, unit=" rows", delay=3) as progress:
        for batch, chunk_counts in results:
            if writer is None:
                writer = pa.ipc.new_stream(sink, batch.schema)
            writer.write_batch(batch)
            for name, value in chunk_counts.items():
                counts[name] = counts.get(name, 0) + value
            counts["rows"] += batch.num_rows
            progress.update(batch.num_rows)
        if writer is not None:
            writer.close()
    return counts
