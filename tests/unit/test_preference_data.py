"""Preference records in the published layouts become token pairs whose completions alone are scored."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from toolkit.config import DataConfig, TrainConfig
from toolkit.data.loader import train_loader
from toolkit.errors import UserError
from toolkit.preference.data import EncodedPairs, PairCollator, build_pairs, pair_lengths
from toolkit.preference.records import detect_layout, to_pair
from toolkit.train.loss import IGNORE

TINY = Path(__file__).resolve().parents[2] / "toolkit" / "assets" / "tiny-llama"
USER = {"role": "user", "content": "What is 2 + 3?"}
SYSTEM = {"role": "system", "content": "Reply with the number only."}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY)


def jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def answer(text):
    return {"role": "assistant", "content": text}


def test_layouts_give_the_same_pair():
    expected = to_pair({"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"}, "explicit", "f:1")
    as_lists = {"prompt": [USER], "chosen": [answer("5")], "rejected": [answer("6")]}
    # UltraFeedback-binarized repeats the prompt inside each answer; HH-RLHF has no prompt at all.
    repeated = {"prompt": "What is 2 + 3?", "chosen": [USER, answer("5")], "rejected": [USER, answer("6")]}
    implicit = {"chosen": [USER, answer("5")], "rejected": [USER, answer("6")]}
    for record in (as_lists, repeated, implicit):
        assert to_pair(record, detect_layout(record, "f:1"), "f:1") == expected
    multi = {"chosen": [SYSTEM, USER, answer("5")], "rejected": [SYSTEM, USER, answer("6")]}
    assert to_pair(multi, "implicit", "f:1").prompt == [SYSTEM, USER]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt": "q", "chosen": "a"}, "f.jsonl:3: missing or empty 'rejected'"),
        ({"prompt": "q", "chosen": "a", "rejected": ""}, "f.jsonl:3: missing or empty 'rejected'"),
        ({"prompt": "q", "chosen": "a", "rejected": "a"}, "f.jsonl:3: 'chosen' is identical to 'rejected'"),
        (
            {"chosen": [USER, answer("5")], "rejected": [SYSTEM, answer("6")]},
            "f.jsonl:3: 'chosen' and 'rejected' share no opening turn",
        ),
        ({"prompt": "q", "chosen": 5, "rejected": "a"}, "'chosen' must be text or a list of turns"),
        (
            {"prompt": "q", "chosen": [{"role": "bot", "content": "a"}], "rejected": "b"},
            "chosen[0]: 'role' is 'bot', not one of",
        ),
    ],
)
def test_malformed_records_name_file_and_line(tmp_path, tokenizer, record, message):
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    if "prompt" not in record:
        good = {"chosen": [USER, answer("5")], "rejected": [USER, answer("6")]}
    path = jsonl(tmp_path / "f.jsonl", [good, good, record])
    with pytest.raises(UserError) as caught:
        build_pairs(DataConfig(train=path, eval_fraction=0), tokenizer, 32, seed=0)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_unknown_layout_lists_the_keys(tmp_path, tokenizer):
    path = jsonl(tmp_path / "f.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(UserError, match=r"f.jsonl:1: keys \[answer, question\] are not a preference pair"):
        build_pairs(DataConfig(train=path, eval_fraction=0), tokenizer, 32, seed=0)


def test_only_completion_tokens_are_scored(tmp_path, tokenizer):
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "16"}] * 2)
    train, _, _ = build_pairs(DataConfig(train=path, eval_fraction=0), tokenizer, 32, seed=0)
    batch = PairCollator(tokenizer.pad_token_id)([train[0], train[1]])
    assert batch["input_ids"].shape[0] == 4  # chosen, chosen, rejected, rejected
    scored = [
        tokenizer.decode(ids[labels != IGNORE]) for ids, labels in zip(batch["input_ids"], batch["labels"])
    ]
    assert scored == ["5<|im_end|>"] * 2 + ["16<|im_end|>"] * 2
    assert (batch["attention_mask"].sum(1) == batch["input_ids"].ne(tokenizer.pad_token_id).sum(1)).all()


def test_prompt_is_cut_from_the_left_then_completions():
    out = EncodedPairs()
    out.add(list(range(10)), [20, 21, 22], [30], max_length=8, keep=4)
    out.add([1, 2], [5, 6], [7], max_length=8, keep=4)
    out.add(list(range(10)), [20] * 6 + [1], [20] * 6 + [2], max_length=8, keep=4)
    assert out.columns["prompt_ids"] == [[6, 7, 8, 9], [1, 2]]
    assert out.columns["chosen_ids"] == [[20, 21, 22], [5, 6]] and out.columns["rejected_ids"][0] == [30]
    assert (out.truncated, out.dropped) == (2, 1)  # the third pair's answers differ only after the cut


def test_formats_mixture_and_summary(tmp_path, tokenizer):
    records = [
        {"prompt": f"What is {i} + 1?", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(12)
    ]
    first = jsonl(tmp_path / "a.jsonl", records)
    second = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist(records[:6]), second)
    third = tmp_path / "c.csv"
    third.write_text("prompt,chosen,rejected\n" + "".join(f"q{i},a{i},b{i}\n" for i in range(4)))
    cfg = DataConfig(train=[first, str(second), str(third)], weights=[1, 1, 2], eval_fraction=0.1)
    train, eval_set, stats = build_pairs(cfg, tokenizer, 32, seed=0)
    again, _, _ = build_pairs(cfg, tokenizer, 32, seed=0)
    assert train["chosen_ids"] == again["chosen_ids"]
    assert stats.train_pairs == {first: 5, str(second): 5, str(third): 10}
    assert len(eval_set) == 2 and len(train) == 20
    assert (
        stats.summary().startswith("data: 20 train pairs (") and "0 truncated, 0 dropped" in stats.summary()
    )


def test_group_by_length_pads_less_and_keeps_every_pair_once(tmp_path, tokenizer):
    # Prompts and answers of 1 to 30 words, so a random batch of pairs pads to far more than its pairs need.
    words = [f"w{i % 7}" for i in range(60)]
    records = [
        {
            "prompt": " ".join(words[: 1 + (7 * i) % 30]),
            "chosen": " ".join(words[: 1 + (11 * i) % 30]),
            "rejected": " ".join(words[: 1 + (5 * i) % 30]) + " x",
        }
        for i in range(64)
    ]
    cfg = DataConfig(train=jsonl(tmp_path / "p.jsonl", records), eval_fraction=0, max_length=256)
    train, _, _ = build_pairs(cfg, tokenizer, 128, seed=0)
    collate = PairCollator(tokenizer.pad_token_id, multiple=1)
    lengths = pair_lengths(train)
    assert [collate([train[i]])["input_ids"].shape[1] for i in range(len(train))] == lengths.tolist()

    def epoch(group: bool):
        data = DataConfig(train="x", group_by_length=group)
        steps = TrainConfig(global_batch_size=8, micro_batch_size=8)
        loader, sampler = train_loader(train, data, steps, 0, 0, False, collate, pair_lengths(train))
        sampler.set_epoch(1)
        picked = [batch["input_ids"].shape for batch in loader]
        return sorted(i for i in sampler), sum(rows * width for rows, width in picked)

    every, padded_slots = epoch(group=False)
    grouped_every, grouped_slots = epoch(group=True)
    assert every == grouped_every == list(range(len(train)))
    least = 2 * int(lengths.sum())  # each pair's two rows are at least its own width
    assert least <= grouped_slots < 0.8 * padded_slots, (least, grouped_slots, padded_slots)
