"""Small data files in every layout and file type, with the awkward records (empty, nothing trained,
too long, line separators, CRLF), written deterministically so encoded rows can be compared across runs."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

WORDS = [
    "the",
    "sea",
    "sun",
    "wind",
    "answer",
    "is",
    "four",
    "hello",
    "help",
    "poem",
    "short",
    "French",
    "bonjour",
    "good",
    "morning",
    "repeat",
]


def sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def conversation(rng: random.Random, turns: int) -> list[dict]:
    messages = [{"role": "system", "content": sentence(rng, 2, 6)}] if rng.random() < 0.5 else []
    for _ in range(turns):
        messages.append({"role": "user", "content": sentence(rng, 1, 12)})
        messages.append({"role": "assistant", "content": sentence(rng, 1, 30)})
    return messages


def records(rng: random.Random, fmt: str, count: int) -> list[dict]:
    out = []
    for i in range(count):
        if fmt == "messages":
            out.append({"messages": conversation(rng, rng.randint(1, 4))})
        elif fmt == "sharegpt":
            names = {"system": "system", "user": "human", "assistant": "gpt"}
            turns = conversation(rng, rng.randint(1, 3))
            out.append({"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in turns]})
        elif fmt == "alpaca":
            extra = sentence(rng, 1, 5) if i % 2 else ""
            out.append({"instruction": sentence(rng, 2, 9), "input": extra, "output": sentence(rng, 1, 20)})
        elif fmt == "prompt_completion":
            out.append({"prompt": sentence(rng, 2, 9), "completion": sentence(rng, 1, 20)})
        else:
            out.append({"text": sentence(rng, 1, 60)})
    return out


def awkward(fmt: str) -> list[dict]:
    """An empty record, one with nothing to train (chat) and one far over any small length limit."""
    long = " ".join(WORDS * 12)
    if fmt == "text":
        return [{"text": ""}, {"text": "line\u2028separator"}, {"text": long}]
    if fmt == "messages":
        return [
            {"messages": []},
            {"messages": [{"role": "user", "content": "no answer\u2028here"}]},
            {"messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "late"}]},
        ]
    return []


def write_cases(folder: Path, count: int = 40) -> dict[str, str]:
    """{case name: file path} for one file per layout, in jsonl, json, csv and parquet."""
    rng = random.Random(0)
    paths = {}
    for fmt, suffix in [
        ("messages", "jsonl"),
        ("sharegpt", "json"),
        ("alpaca", "csv"),
        ("text", "parquet"),
        ("prompt_completion", "jsonl"),
        ("text", "jsonl"),
    ]:
        rows = records(rng, fmt, count)
        rows[count // 2 : count // 2] = awkward(fmt)
        path = folder / f"{fmt}.{suffix}"
        if suffix == "jsonl":
            path.write_bytes(b"".join(json.dumps(r).encode() + b"\r\n" for r in rows) + b"\n")
        elif suffix == "json":
            path.write_text(json.dumps(rows, indent=1))
        elif suffix == "csv":
            with path.open("w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
        else:
            pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
        paths[f"{fmt}.{suffix}"] = str(path)
    return paths


def digest(rows) -> str:
    """One hash over every row's input ids and labels, in order."""
    import hashlib

    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps([list(row["input_ids"]), list(row["labels"])]).encode())
    return h.hexdigest()
