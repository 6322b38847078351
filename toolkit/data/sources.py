"""Read one data source into a list of records: local files through our own readers (so a bad line is
reported by its line number), anything else through `datasets.load_dataset`."""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from toolkit.errors import UserError

FILE_TYPES = (".jsonl", ".json", ".parquet", ".csv")


@dataclass
class Source:
    name: str
    """The source as written in the config; error messages name it."""
    records: Sequence[dict]
    """One dict per example (a list, or a `datasets.Dataset` for hub sources)."""
    identity: str
    """Changes whenever the records can: a content hash for files, the datasets fingerprint for the hub."""
    line_numbers: list[int] | None = None
    """File line of each record, for formats that have lines."""

    def where(self, i: int) -> str:
        if self.line_numbers is not None:
            return f"{self.name}:{self.line_numbers[i]}"
        return f"{self.name}: record {i + 1}"


def read_source(name: str, split: str) -> Source:
    """An existing file is read by its extension; a missing path is an error, never a hub lookup."""
    path = Path(name).expanduser()
    if path.is_file():
        return _read_file(name, path)
    if path.is_dir() or not _looks_local(name):
        return _read_hub(name, split)
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
    raw = path.read_bytes()
    identity = hashlib.sha256(raw).hexdigest()
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            records = pq.read_table(pa.BufferReader(raw)).to_pylist()
        except pa.ArrowException as exc:
            raise UserError(f"{name}: not a readable Parquet file ({exc})") from None
        return Source(name, records, identity)
    if suffix not in FILE_TYPES:
        raise UserError(
            f"{name}: unsupported file type {suffix or '(none)'}; use one of {', '.join(FILE_TYPES)}"
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if suffix == ".csv":
        return _parse_csv(name, text, identity)
    if suffix == ".json":
        return _parse_json(name, text, identity)
    return _parse_jsonl(name, text, identity)


def _parse_jsonl(name: str, text: str, identity: str) -> Source:
    records, lines = [], []
    # Split on "\n" only: splitlines() would also break at U+2028 and friends, which JSON strings may hold.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{name}:{number}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, dict):
            raise UserError(f"{name}:{number}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
        lines.append(number)
    return Source(name, records, identity, lines)


def _parse_json(name: str, text: str, identity: str) -> Source:
    """A .json file holds either one list of records or JSON lines."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            return _parse_jsonl(name, text, identity)
        raise UserError(f"{name}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if isinstance(data, dict) and "\n" not in text.strip():
        return _parse_jsonl(name, text, identity)
    if not isinstance(data, list):
        raise UserError(f"{name}: expected a list of records or JSON lines, got {type(data).__name__}")
    for i, record in enumerate(data):
        if not isinstance(record, dict):
            raise UserError(f"{name}: record {i + 1}: expected a JSON object, got {type(record).__name__}")
    return Source(name, data, identity)


def _parse_csv(name: str, text: str, identity: str) -> Source:
    reader = csv.DictReader(io.StringIO(text))
    records, lines = [], []
    try:
        for row in reader:
            records.append(row)
            lines.append(reader.line_num)
    except csv.Error as exc:
        raise UserError(f"{name}:{reader.line_num}: not valid CSV ({exc})") from None
    return Source(name, records, identity, lines)


def _read_hub(name: str, split: str) -> Source:
    try:
        dataset = datasets.load_dataset(name, split=split)
    except Exception as exc:  # datasets raises many types; each means the id, split or access is wrong
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"{name}: not a local file, and datasets.load_dataset({name!r}, split={split!r}) failed: {reason}"
        ) from None
    return Source(name, dataset, f"hub:{name}:{split}:{dataset._fingerprint}")
