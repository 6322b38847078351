"""data.streaming: rows encoded and packed on the fly, shared out between processes without overlap, and
any row reachable again from its number alone (what a resumed run asks for)."""

from __future__ import annotations

import json
import re

import pytest
from helpers import REPO
from transformers import AutoTokenizer

from toolkit import data
from toolkit.config import DataConfig, TrainConfig
from toolkit.data import build, streaming
from toolkit.train.loss import IGNORE

ASSETS = REPO / "toolkit" / "assets"
RECORDS = 90


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")


@pytest.fixture(autouse=True)
def small_chunks(private_cache, monkeypatch):
    monkeypatch.setattr(build, "STREAM_CHUNK", 4)  # many chunks, so every process gets several


@pytest.fixture
def corpus(tmp_path) -> str:
    """Plain text documents of varied length, each naming itself ("doc 17")."""
    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": f"doc {i} " + "the sea and the sun " * (1 + i % 7)}) for i in range(RECORDS)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def stream(path: str, tokenizer, max_length: int = 64):
    cfg = DataConfig(train=path, streaming=True, max_length=max_length)
    rows, _, stats = data.build_datasets(cfg, tokenizer, 0)
    return rows, stats


def docs(tokenizer, row: dict) -> list[int]:
    """The documents in a packed row, in order."""
    return [int(n) for n in re.findall(r"doc (\d+)", tokenizer.decode(row["input_ids"]))]


def serve(rows, rank: int, world: int, micro: int, numbers, monkeypatch) -> list[dict]:
    """Rows by their numbers in the step-shaped order, asked on process `rank` of `world`."""
    monkeypatch.setattr(streaming, "rank_and_world", lambda: (rank, world))
    rows.micro_batch_size = micro
    return [rows[i] for i in numbers]


def owned(rank: int, world: int, micro: int, count: int) -> list[int]:
    return [i for i in range(count) if i // micro % world == rank]


def test_rows_are_packed_whole_examples_within_max_length(corpus, tokenizer, monkeypatch):
    rows, stats = stream(corpus, tokenizer)
    assert "streaming" in stats.summary()
    served = serve(rows, 0, 1, 4, range(40), monkeypatch)
    assert [d for row in served for d in docs(tokenizer, row)][:40] == list(range(40))
    for row in served:
        assert len(row["input_ids"]) <= 64
        starts = [k for k, p in enumerate(row["position_ids"]) if p == 0]
        assert len(starts) == len(docs(tokenizer, row)) >= 1
        assert all(row["labels"][k] == IGNORE for k in starts)


def test_processes_read_disjoint_shares_that_cover_the_corpus(corpus, tokenizer, monkeypatch):
    rows, _ = stream(corpus, tokenizer)
    seen = []
    for rank in range(2):
        served = serve(rows, rank, 2, 2, owned(rank, 2, 2, 64), monkeypatch)
        first_pass = []
        for row in served:
            first_pass += docs(tokenizer, row)
        # Each process's stream repeats after its share; keep one pass of it.
        seen.append(set(first_pass[: first_pass.index(first_pass[0], 1)]))
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(range(RECORDS))


@pytest.mark.parametrize("notes", [True, False], ids=["from-noted-position", "replayed"])
def test_a_new_stream_serves_the_same_rows_from_any_row_number(
    corpus, tokenizer, monkeypatch, notes, tmp_path
):
    numbers = owned(1, 2, 2, 400)
    straight, _ = stream(corpus, tokenizer)
    expected = serve(straight, 1, 2, 2, numbers, monkeypatch)
    if not notes:
        for path in (tmp_path / "hf-cache").rglob("*-of-2.jsonl"):
            path.unlink()
    resumed, _ = stream(corpus, tokenizer)
    middle = len(numbers) // 2 + 3  # not at a noted row
    assert serve(resumed, 1, 2, 2, numbers[middle:], monkeypatch) == expected[middle:]


def test_streaming_loader_deals_row_numbers_in_order(corpus, tokenizer):
    rows, _ = stream(corpus, tokenizer)
    train = TrainConfig(max_steps=3, global_batch_size=4, micro_batch_size=2)
    loader, sampler = data.train_loader(rows, DataConfig(streaming=True), train, 0, 0, False)
    assert list(sampler) == list(range(12))
    batches = list(loader)
    assert len(batches) == 6 and all("position_ids" in b for b in batches)
