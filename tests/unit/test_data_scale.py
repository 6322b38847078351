"""Encoding at scale: chunked, cached rows identical to the encoder before chunking (hashes saved from it
in data_reference.json), the same rows from several processes, and memory that does not grow with the
source."""

from __future__ import annotations

import hashlib
import json
import tracemalloc
from pathlib import Path

import datasets
import pytest
from data_cases import digest, write_cases
from helpers import REPO
from transformers import AutoTokenizer

from toolkit import data
from toolkit.config import DataConfig
from toolkit.data import build

ASSETS = REPO / "toolkit" / "assets"
REFERENCE = json.loads((Path(__file__).parent / "data_reference.json").read_text())
SETTINGS = [(64, True), (512, False)]
pytestmark = pytest.mark.usefixtures("private_cache")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, str]:
    paths = write_cases(tmp_path_factory.mktemp("cases"))
    return {**paths, "demo": str(ASSETS / "demo" / "train.jsonl")}


def encoded(path: str, tokenizer, max_length: int, only: bool, num_proc: int = 1) -> dict:
    cfg = DataConfig(
        train=path, eval_fraction=0.0, max_length=max_length, assistant_only_loss=only, num_proc=num_proc
    )
    train, _, stats = data.build_datasets(cfg, tokenizer, 0)
    return {
        "rows": len(train),
        "truncated": stats.truncated,
        "dropped": stats.dropped,
        "digest": digest(train),
    }


def test_rows_are_those_of_the_encoder_before_chunking(cases, tokenizer, monkeypatch):
    monkeypatch.setattr(build, "CHUNK", 16)  # several chunks per file, a partial one last
    for name, path in cases.items():
        for max_length, only in SETTINGS:
            assert encoded(path, tokenizer, max_length, only) == REFERENCE[f"{name}|{max_length}|{only}"], (
                name
            )


@pytest.mark.parametrize("packing", [False, True])
def test_demo_train_set_and_packed_rows_are_unchanged(tokenizer, packing, monkeypatch):
    monkeypatch.chdir(REPO)  # the data line names the file as the config wrote it
    cfg = DataConfig(train="toolkit/assets/demo/train.jsonl", packing=packing, max_length=256)
    train, eval_set, stats = data.build_datasets(cfg, tokenizer, 3)
    rows = hashlib.sha256()
    for row in train:
        rows.update(json.dumps([row["input_ids"], row["labels"], row.get("position_ids")]).encode())
    expected = REFERENCE[f"build|packing={packing}"]
    assert (stats.summary(), rows.hexdigest(), digest(eval_set)) == (
        expected["summary"],
        expected["train"],
        expected["eval"],
    )


def test_several_processes_give_the_same_rows_order_and_counts(cases, tokenizer, monkeypatch, tmp_path):
    monkeypatch.setattr(build, "CHUNK", 7)  # many chunks, so workers finish them out of order
    for name in ("messages.jsonl", "alpaca.csv", "text.parquet", "demo"):
        results = []
        for num_proc in (1, 2):
            monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / f"{name}-{num_proc}"))
            results.append(encoded(cases[name], tokenizer, 64, True, num_proc))
        assert results[0] == results[1], name


def peak_python_memory(path: Path, count: int, tokenizer) -> int:
    words = " ".join(["the sea and the sun and the wind"] * 12)
    path.write_text("".join(json.dumps({"text": f"{i} {words}"}) + "\n" for i in range(count)))
    tracemalloc.start()
    try:
        encoded(str(path), tokenizer, 256, True)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_python_memory_while_encoding_does_not_grow_with_the_source(tokenizer, monkeypatch, tmp_path):
    """Python objects only (the tokenizer's and Arrow's own buffers are not traced): before chunked writing
    every encoded row was held as Python lists, ~4 KB per row here."""
    monkeypatch.setattr(build, "CHUNK", 50)
    small = peak_python_memory(tmp_path / "small.jsonl", 200, tokenizer)
    large = peak_python_memory(tmp_path / "large.jsonl", 1600, tokenizer)
    assert large < small + 1_000_000, (small, large)
