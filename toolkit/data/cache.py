"""A disk cache of encoded sources: under `main_process_first` the main process encodes and saves, and
the other ranks (and later runs with the same data, tokenizer and settings) load its result."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import datasets
import pyarrow as pa

# Bump when encoding changes, so rows cached by older code are not reused.
CACHE_VERSION = 1


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


def load_or_build(key: str, build: Callable[[], tuple[dict, dict]]) -> tuple[datasets.Dataset, dict]:
    """Load entry `key`, building it first when missing; `build` returns (columns, counts)."""
    path = cache_root() / key
    if not path.is_dir():
        columns, counts = build()
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written beside the entry and renamed into place, so a reader never sees half an entry.
        staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{key}.partial-"))
        _write_arrow(columns, staging / "rows.arrow")
        (staging / "counts.json").write_text(json.dumps(counts))
        try:
            staging.rename(path)
        except OSError:  # another process finished the same entry first
            shutil.rmtree(staging)
    rows = datasets.Dataset.from_file(str(path / "rows.arrow"))
    return rows, json.loads((path / "counts.json").read_text())


def _write_arrow(columns: dict[str, list[list[int]]], path: Path) -> None:
    """An Arrow stream file, the layout `datasets` memory-maps (written directly, without a progress bar)."""
    table = pa.table({name: pa.array(rows, type=pa.list_(pa.int32())) for name, rows in columns.items()})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
