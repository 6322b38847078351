"""A run's metrics.jsonl as the page plots it: every numeric metric as at most MAX_POINTS [step, value]
points, the last one exact, read once and then only as it grows.

A long file is not parsed whole: lines are told apart by their kind (the second key and the number of keys:
a training step's line, an evaluation's, a recipe's occasional ones) and each kind keeps at most 2 x KEEP
parsed lines, every line while it is short, then every 2nd, 4th, ... as it grows, and always its newest
line. So a 200,000-step file costs a split and a few thousand JSON parses, and a live run each second only
the lines it appended."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

MAX_POINTS = 1000
KEEP = 2000
SKIPPED = ("step", "time")


@dataclass
class _Kind:
    """The kept lines of one kind of line: every `stride`-th, at most 2 x KEEP, and the newest."""

    stride: int = 1
    seen: int = 0
    samples: list[dict] = field(default_factory=list)
    newest: bytes = b""
    newest_kept: bool = False

    def extend(self, lines: list[bytes]) -> None:
        while len(self.samples) + (self.seen % self.stride + len(lines)) // self.stride > 2 * KEEP:
            self.samples, self.stride = self.samples[::2], self.stride * 2
        first = -self.seen % self.stride
        parsed = [_parse(line) for line in lines[first :: self.stride]]
        self.samples += [record for record in parsed if record is not None]
        self.newest = lines[-1]
        self.newest_kept = (len(lines) - 1 - first) % self.stride == 0 and parsed[-1:] != [None]
        self.seen += len(lines)

    def records(self) -> list[dict]:
        newest = None if self.newest_kept else _parse(self.newest)
        return self.samples + ([newest] if newest is not None else [])


@dataclass
class _File:
    inode: int = -1
    offset: int = 0
    lines: int = 0
    kinds: dict[tuple[bytes, int], _Kind] = field(default_factory=dict)
    shown: dict | None = None
    shown_at: int = -1


class MetricsReader:
    """The page's view of metrics files; the files stay the record (a resumed run rewrites its file: it is
    read anew)."""

    def __init__(self):
        self._files: dict[Path, _File] = {}

    def series(self, path: Path) -> tuple[dict[str, list[list[float]]], int]:
        """({metric: [[step, value], ...]}, lines read) for `path` ({} and 0 when it does not exist)."""
        try:
            stat = path.stat()
        except OSError:
            return {}, 0
        state = self._files.get(path)
        if state is None or state.inode != stat.st_ino or stat.st_size < state.offset:
            state = self._files[path] = _File(inode=stat.st_ino)
        if stat.st_size > state.offset:
            with path.open("rb") as handle:
                handle.seek(state.offset)
                data = handle.read(stat.st_size - state.offset)
            whole = data.rfind(b"\n") + 1  # a line still being written waits for the next read
            for kind, lines in _by_kind(data[:whole].split(b"\n")).items():
                state.kinds.setdefault(kind, _Kind()).extend(lines)
                state.lines += len(lines)
            state.offset += whole
        if state.shown_at != state.offset:
            records = [r for kind in state.kinds.values() for r in kind.records()]
            state.shown, state.shown_at = columns(records), state.offset
        return state.shown, state.lines


def _by_kind(lines: list[bytes]) -> dict[tuple[bytes, int], list[bytes]]:
    """Lines grouped by their second key and their number of keys, in order."""
    groups: dict[tuple[bytes, int], list[bytes]] = {}
    for line in lines:
        if line:
            start = line.find(b', "') + 3
            groups.setdefault((line[start : line.find(b'"', start)], line.count(b'": ')), []).append(line)
    return groups


def _parse(line: bytes) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def columns(records: list[dict], max_points: int = MAX_POINTS) -> dict[str, list[list[float]]]:
    """Every numeric metric of `records` as [[step, value], ...] by step, at most `max_points` each (bucket
    means; the last point exact)."""
    found: dict[str, list[list[float]]] = {}
    for record in records:
        step = record["step"]
        for key, value in record.items():
            if key in SKIPPED or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                found.setdefault(key, []).append([step, value])
    return {key: downsample(sorted(points), max_points) for key, points in found.items()}


def downsample(points: list[list[float]], max_points: int) -> list[list[float]]:
    if len(points) <= max_points:
        return points
    width = (len(points) - 1) / (max_points - 1)
    out = []
    for i in range(max_points - 1):
        bucket = points[int(i * width) : max(int((i + 1) * width), int(i * width) + 1)]
        out.append([bucket[-1][0], sum(p[1] for p in bucket) / len(bucket)])
    return [*out, points[-1]]
