"""Read one data source as a stream of chunks of records: local files through our own readers (so a bad
line is reported by its line number), anything else through `datasets.load_dataset`. Only a chunk at a
time is held in memory, except for a `.json` list, which is one JSON value and is read whole."""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from toolkit.errors import UserError

FILE_TYPES = (".jsonl", ".json", ".parquet", ".csv")


@dataclass
class Chunk:
    """Consecutive records of one source. JSON lines stay raw bytes until `records()`, so the process that
    encodes a chunk also parses it."""

    name: str
    """The source as written in the config; error messages name it."""
    start: int
    """Index of the first record in the source."""
    items: list
    """Records (dicts), or raw JSON lines when `line_numbers` is set and `raw` is true."""
    line_numbers: list[int] | None = None
    """File line of each record, for formats that have lines."""
    raw: bool = False

    def __len__(self) -> int:
        return len(self.items)

    def records(self) -> list[dict]:
        if not self.raw:
            return self.items
        return [_parse_line(self.name, line, number) for line, number in zip(self.items, self.line_numbers)]

    def where(self, i: int) -> str:
        """Where record `i` of this chunk is, for error messages."""
        if self.line_numbers is not None:
            return f"{self.name}:{self.line_numbers[i]}"
        return f"{self.name}: record {self.start + i + 1}"


@dataclass
class Source:
    name: str
    """The source as written in the config; error messages name it."""
    identity: str
    """Changes whenever the records can: a content hash for files, the datasets fingerprint for the hub."""
    read: Callable[[int], Iterator[Chunk]]
    """Chunks of at most the given number of records, first to last; each call starts over."""

    def first(self) -> tuple[dict, str] | None:
        """(first record, where it is), or None for a source without records."""
        for chunk in self.read(1):
            return chunk.records()[0], chunk.where(0)
        return None


def train_sources(data_cfg) -> list[str]:
    """The config's `data.train` as a list, one entry a source."""
    return data_cfg.train if isinstance(data_cfg.train, list) else [data_cfg.train]


def read_source(name: str, split: str, streaming: bool = False) -> Source:
    """An existing file is read by its extension; a missing path is an error, never a hub lookup. With
    `streaming`, a hub dataset is read as it downloads instead of being prepared on disk first."""
    path = Path(name).expanduser()
    if path.is_file():
        return _read_file(name, path)
    if path.is_dir() or not _looks_local(name):
        return _read_hub(name, split, streaming)
    raise UserError(f"{name}: file not found")


def _looks_local(name: str) -> bool:
    # Hub ids are "name" or "owner/name"; anything else that is not on disk was meant as a file.
    return (
        name.lower().endswith(FILE_TYPES)
        or name.startswith(("/", ".", "~"))
        or name.count("/") > 1
        or "\\" in name
    )


def _read_file(name: str, path: Path) -> Source:
    suffix = path.suffix.lower()
    if suffix not in FILE_TYPES:
        raise UserError(
            f"{name}: unsupported file type {suffix or '(none)'}; use one of {', '.join(FILE_TYPES)}"
        )
    identity = file_hash(path)
    readers = {
        ".parquet": _parquet_chunks,
        ".csv": _csv_chunks,
        ".json": _json_chunks,
        ".jsonl": _jsonl_chunks,
    }
    reader = readers[suffix]
    return Source(name, identity, lambda size: reader(name, path, size))


def file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _parquet_chunks(name: str, path: Path, size: int) -> Iterator[Chunk]:
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=size)
        start = 0
        for batch in batches:
            yield Chunk(name, start, batch.to_pylist())
            start += batch.num_rows
    except pa.ArrowException as exc:
        raise UserError(f"{name}: not a readable Parquet file ({exc})") from None


def _lines(name: str, path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) for every non-blank line, checked to be UTF-8. Split on b"\\n" only: text-mode
    reading would also break at U+2028 and friends, which JSON strings may hold."""
    offset = 0
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if number == 1 and line.startswith(b"\xef\xbb\xbf"):
                line, offset = line[3:], 3
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(
                    f"{name}: not UTF-8 text ({exc.reason} at byte {offset + exc.start})"
                ) from None
            offset += len(line)
            if text.strip():
                yield number, text


def _jsonl_chunks(name: str, path: Path, size: int) -> Iterator[Chunk]:
    start, lines, numbers = 0, [], []
    for number, line in _lines(name, path):
        lines.append(line)
        numbers.append(number)
        if len(lines) == size:
            yield Chunk(name, start, lines, numbers, raw=True)
            start, lines, numbers = start + size, [], []
    if lines:
        yield Chunk(name, start, lines, numbers, raw=True)


def _parse_line(name: str, line: str, number: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{name}:{number}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise UserError(f"{name}:{number}: expected a JSON object, got {type(record).__name__}")
    return record


def _json_chunks(name: str, path: Path, size: int) -> Iterator[Chunk]:
    """A .json file holds either one list of records or JSON lines."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            yield from _jsonl_chunks(name, path, size)
            return
        raise UserError(f"{name}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if isinstance(data, dict) and "\n" not in text.strip():
        yield from _jsonl_chunks(name, path, size)
        return
    if not isinstance(data, list):
        raise UserError(f"{name}: expected a list of records or JSON lines, got {type(data).__name__}")
    for i, record in enumerate(data):
        if not isinstance(record, dict):
            raise UserError(f"{name}: record {i + 1}: expected a JSON object, got {type(record).__name__}")
    for start in range(0, len(data), size):
        yield Chunk(name, start, data[start : start + size])


def _csv_chunks(name: str, path: Path, size: int) -> Iterator[Chunk]:
    start, records, lines = 0, [], []
    with path.open(encoding="utf-8-sig", newline="") as handle:
        reader = csv.DictReader(handle)
        try:
            for row in reader:
                records.append(row)
                lines.append(reader.line_num)
                if len(records) == size:
                    yield Chunk(name, start, records, lines)
                    start, records, lines = start + size, [], []
        except csv.Error as exc:
            raise UserError(f"{name}:{reader.line_num}: not valid CSV ({exc})") from None
        except UnicodeDecodeError as exc:
            raise UserError(f"{name}: not UTF-8 text ({exc.reason})") from None
    if records:
        yield Chunk(name, start, records, lines)


def _read_hub(name: str, split: str, streaming: bool) -> Source:
    try:
        dataset = datasets.load_dataset(name, split=split, **({"streaming": True} if streaming else {}))
    except Exception as exc:  # datasets raises many types; each means the id, split or access is wrong
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"{name}: not a local file, and datasets.load_dataset({name!r}, split={split!r}) failed: {reason}"
        ) from None

    def read(size: int) -> Iterator[Chunk]:
        start = 0
        for columns in dataset.iter(batch_size=size):
            records = [
                dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)
            ]
            yield Chunk(name, start, records)
            start += len(records)

    # A streamed dataset has no fingerprint: the same id and split stand for the same records.
    fingerprint = getattr(dataset, "_fingerprint", "streamed")
    return Source(name, f"hub:{name}:{split}:{fingerprint}", read)
