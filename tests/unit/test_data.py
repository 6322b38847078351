"""The data pipeline on small files and a tokenizer trained here (no downloads)."""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import REPO
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from toolkit import data
from toolkit.config import DataConfig
from toolkit.data.formats import detect_format
from toolkit.data.mixture import split_sources
from toolkit.errors import UserError

pytestmark = pytest.mark.usefixtures("private_cache")

IGNORE = -100
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
CHATML = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama 3 layout: a bos written by the template, header tokens, trimmed content, no newline after a turn.
LLAMA3 = (
    "{{- '<|begin_of_text|>' }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Zephyr layout: plain-text role tags and a closing "</s>" that is ordinary text for this tokenizer.
ZEPHYR = (
    "{%- for m in messages %}{{- '<|' + m['role'] + '|>\\n' + m['content'] + '</s>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)
CORPUS = [
    "You are a helpful assistant. Hi there! How can I help you today?",
    "What is two plus two? Repeat after me: 4. The answer is 4.",
    "Write a short poem about the sea, the sun and the wind.",
    "Instruction: translate the sentence into French. Input: good morning. Output: bonjour.",
    "user assistant system </s> <|user|> <|assistant|> <|system|>",
] * 20
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Hello! How can I help you today?"},
    # The second answer also ends the user turn before it: masking must still pick the assistant's copy.
    {"role": "user", "content": "Repeat after me: 4"},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture(scope="session")
def bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def make_tokenizer(bpe: Tokenizer, template: str | None = CHATML) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture
def tokenizer(bpe) -> PreTrainedTokenizerFast:
    return make_tokenizer(bpe)


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def config(train, **overrides) -> DataConfig:
    return DataConfig(train=train, eval_fraction=overrides.pop("eval_fraction", 0.0), **overrides)


def trained_runs(tokenizer, row: dict) -> list[str]:
    """The decoded text of each contiguous run of trained tokens."""
    runs, current = [], []
    for token, label in zip(row["input_ids"], row["labels"], strict=True):
        if label != IGNORE:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [tokenizer.decode(run) for run in runs]


# Formats ----------------------------------------------------------------------------------------------

CHAT_CASES = {
    "messages": (
        {"messages": [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Hello!"}]},
        [("user", "Hi there!"), ("assistant", "Hello!")],
    ),
    "sharegpt": (
        {
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "Hello!"},
            ]
        },
        [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!")],
    ),
    "alpaca": (
        {"instruction": "Translate into French.", "input": "good morning", "output": "bonjour"},
        [("user", "Translate into French.\n\ngood morning"), ("assistant", "bonjour")],
    ),
    "prompt_completion": (
        {"prompt": "What is two plus two?", "completion": "4"},
        [("user", "What is two plus two?"), ("assistant", "4")],
    ),
}


@pytest.mark.parametrize("fmt", list(CHAT_CASES))
@pytest.mark.parametrize("declared", [True, False], ids=["declared", "auto"])
def test_chat_formats_render_through_the_template(tmp_path, tokenizer, fmt, declared):
    record, turns = CHAT_CASES[fmt]
    path = write_jsonl(tmp_path / "d.jsonl", [record])
    train, eval_set, stats = data.build_datasets(
        config(path, format=fmt if declared else "auto"), tokenizer, 0
    )
    messages = [{"role": role, "content": content} for role, content in turns]
    expected = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(train[0]["input_ids"]) == expected
    assert trained_runs(tokenizer, train[0]) == [turns[-1][1] + "<|im_end|>"]
    assert eval_set is None
    assert stats.train_examples == {path: 1}


def test_alpaca_without_input_is_the_instruction_alone(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Say hi.", "output": "hi"}])
    train, _, _ = data.build_datasets(config(path), tokenizer, 0)
    assert "<|im_start|>user\nSay hi.<|im_end|>" in tokenizer.decode(train[0]["input_ids"])


def test_text_format_trains_every_token_and_appends_eos(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "The sun and the sea."}])
    train, _, stats = data.build_datasets(config(path), tokenizer, 0)
    ids = tokenizer("The sun and the sea.")["input_ids"] + [tokenizer.eos_token_id]
    assert train[0] == {"input_ids": ids, "labels": ids}
    assert stats.label_tokens == len(ids)


def test_auto_detection_picks_each_format():
    for fmt, (record, _) in CHAT_CASES.items():
        assert detect_format(record, "x") == fmt
    assert detect_format({"text": "a", "id": 3}, "x") == "text"


def test_json_parquet_and_csv_sources(tmp_path, tokenizer):
    records = [{"prompt": f"question {i}", "completion": f"answer {i}"} for i in range(3)]
    (tmp_path / "list.json").write_text(json.dumps(records))
    (tmp_path / "lines.json").write_text("\n".join(json.dumps(r) for r in records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
    (tmp_path / "d.csv").write_text(
        "prompt,completion\n" + "".join(f"question {i},answer {i}\n" for i in range(3))
    )
    reference, _, _ = data.build_datasets(config(write_jsonl(tmp_path / "d.jsonl", records)), tokenizer, 0)
    for name in ("list.json", "lines.json", "d.parquet", "d.csv"):
        train, _, _ = data.build_datasets(config(str(tmp_path / name)), tokenizer, 0)
        assert train.to_list() == reference.to_list(), name


def test_hub_ids_go_to_load_dataset(monkeypatch, tokenizer):
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list([{"text": "hello from the hub"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    train, _, _ = data.build_datasets(config("someone/some-dataset", split="train_sft"), tokenizer, 0)
    assert calls == [("someone/some-dataset", "train_sft")]
    assert tokenizer.decode(train[0]["input_ids"]) == "hello from the hub<|im_end|>"


# Masking ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "closing"),
    [(CHATML, "<|im_end|>"), (LLAMA3, "<|eot_id|>"), (ZEPHYR, "</s>")],
    ids=["chatml", "llama3", "zephyr"],
)
def test_assistant_only_loss_trains_exactly_the_answers_and_their_end_of_turn(
    tmp_path, bpe, template, closing
):
    tokenizer = make_tokenizer(bpe, template)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    train, _, stats = data.build_datasets(config(path), tokenizer, 0)
    row = train[0]
    assert tokenizer.decode(row["input_ids"]) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert trained_runs(tokenizer, row) == [f"Hello! How can I help you today?{closing}", f"4{closing}"]
    assert stats.label_tokens == sum(label != IGNORE for label in row["labels"])


def test_train_on_all_tokens(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    train, _, _ = data.build_datasets(config(path, assistant_only_loss=False), tokenizer, 0)
    assert train[0]["labels"] == train[0]["input_ids"]
    assert tokenizer.decode(train[0]["input_ids"]) == tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False
    )


def test_missing_chat_template_gets_chatml_once(tmp_path, bpe, caplog):
    tokenizer = make_tokenizer(bpe, template=None)
    with caplog.at_level(logging.WARNING):
        assert data.ensure_chat_template(tokenizer) is True
        assert data.ensure_chat_template(tokenizer) is False
    assert len([r for r in caplog.records if "no chat template" in r.getMessage()]) == 1
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    train, _, _ = data.build_datasets(config(path), tokenizer, 0)
    assert trained_runs(tokenizer, train[0]) == ["Hello! How can I help you today?<|im_end|>", "4<|im_end|>"]


def test_truncation_is_counted_once(tmp_path, tokenizer, caplog):
    records = [
        {"prompt": "Hi", "completion": "The answer is 4. " * 20},
        {"prompt": "Hi", "completion": "4"},
    ] * 3
    path = write_jsonl(tmp_path / "long.jsonl", records)
    with caplog.at_level(logging.WARNING):
        train, _, stats = data.build_datasets(config(path, max_length=24), tokenizer, 0)
    assert stats.truncated == 3 and stats.dropped == 0 and len(train) == 6
    assert max(len(row["input_ids"]) for row in train) == 24
    assert [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()] == [
        "3 examples were longer than data.max_length=24 tokens and were truncated"
    ]


def test_examples_without_trained_tokens_are_dropped_and_counted(tmp_path, tokenizer):
    records = [
        {"messages": [{"role": "user", "content": "Hi"}]},
        {"messages": []},
        {"messages": CONVERSATION},
    ]
    train, _, stats = data.build_datasets(config(write_jsonl(tmp_path / "d.jsonl", records)), tokenizer, 0)
    assert (len(train), stats.dropped) == (1, 2)


# Mixture, eval split, determinism ---------------------------------------------------------------------


def text_source(tmp_path: Path, prefix: str, count: int) -> str:
    return write_jsonl(tmp_path / f"{prefix}.jsonl", [{"text": f"{prefix} {i}"} for i in range(count)])


def source_of(tokenizer, row: dict) -> str:
    return tokenizer.decode(row["input_ids"]).split()[0]


def test_weighted_mixture_follows_the_weights(tmp_path, tokenizer):
    big, small = text_source(tmp_path, "sun", 30), text_source(tmp_path, "sea", 10)
    train, _, stats = data.build_datasets(config([big, small], weights=[2, 1]), tokenizer, 7)
    origins = [source_of(tokenizer, row) for row in train]
    # 40 rows in all, split 2:1 (26.7 -> 27 and 13.3 -> 13): the small source is repeated to fill its share.
    assert (origins.count("sun"), origins.count("sea")) == (27, 13)
    assert stats.train_examples == {big: 27, small: 13}
    sea_rows = [tokenizer.decode(row["input_ids"]) for row in train if source_of(tokenizer, row) == "sea"]
    assert len(set(sea_rows)) == 10
    assert origins != sorted(origins), "the mixture is shuffled"


def test_sources_without_weights_are_concatenated(tmp_path, tokenizer):
    first, second = text_source(tmp_path, "sun", 3), text_source(tmp_path, "sea", 2)
    train, _, stats = data.build_datasets(config([first, second]), tokenizer, 0)
    assert [tokenizer.decode(r["input_ids"]) for r in train] == [
        "sun 0<|im_end|>",
        "sun 1<|im_end|>",
        "sun 2<|im_end|>",
        "sea 0<|im_end|>",
        "sea 1<|im_end|>",
    ]
    assert stats.train_examples == {first: 3, second: 2}


@pytest.mark.parametrize(("fraction", "eval_size"), [(0.1, 2), (0.01, 1), (0.0, 0)])
def test_eval_fraction_holds_out_rows(tmp_path, tokenizer, fraction, eval_size):
    path = text_source(tmp_path, "sun", 20)
    train, eval_set, stats = data.build_datasets(config(path, eval_fraction=fraction), tokenizer, 3)
    assert len(train) == 20 - eval_size and stats.eval_examples == eval_size
    if eval_size:
        texts = {tokenizer.decode(r["input_ids"]) for r in train}
        assert not texts & {tokenizer.decode(r["input_ids"]) for r in eval_set}
    else:
        assert eval_set is None


def test_eval_file_is_used_whole(tmp_path, tokenizer):
    cfg = config(text_source(tmp_path, "sun", 5), eval=text_source(tmp_path, "sea", 3), eval_fraction=0.5)
    train, eval_set, _ = data.build_datasets(cfg, tokenizer, 0)
    assert (len(train), len(eval_set)) == (5, 3)


def test_same_seed_same_data_and_order(tmp_path, tokenizer):
    cfg = config(
        [text_source(tmp_path, "sun", 12), text_source(tmp_path, "sea", 5)], weights=[1, 1], eval_fraction=0.2
    )
    first = data.build_datasets(cfg, tokenizer, 11)
    second = data.build_datasets(cfg, tokenizer, 11)
    other = data.build_datasets(cfg, tokenizer, 12)
    assert first[0].to_list() == second[0].to_list() and first[1].to_list() == second[1].to_list()
    assert first[0].to_list() != other[0].to_list()


def test_split_is_pinned_for_a_seed():
    # SFT examples and preference pairs both go through split_sources: a change in which rows are held out,
    # in the mixture or in the use of the seed shows here.
    sources = [
        datasets.Dataset.from_dict({"id": [f"{s}{i}" for i in range(n)]}) for s, n in (("a", 6), ("b", 4))
    ]
    split = split_sources(sources, None, 0.2, [1, 1], np.random.default_rng(5))
    assert split.train["id"] == ["a5", "a0", "b2", "a1", "a4", "b2", "b3", "b3"]
    assert split.eval["id"] == ["b0", "b1"] and split.per_name(["x", "x"]) == {"x": 8}
    given = split_sources(sources, sources[1], 0.2, None, np.random.default_rng(5))
    assert (
        given.train["id"] == [f"a{i}" for i in range(6)] + ["b0", "b1", "b2", "b3"]
        and given.eval is sources[1]
    )


def test_encoding_runs_under_main_process_first_and_is_cached(tmp_path, tokenizer):
    entered = []

    @contextmanager
    def main_process_first():
        entered.append(True)
        yield

    path = text_source(tmp_path, "sun", 4)
    data.build_datasets(config(path), tokenizer, 0, main_process_first)
    train, _, _ = data.build_datasets(config(path), tokenizer, 0, main_process_first)
    assert entered == [True, True]
    cache = Path(datasets.config.HF_DATASETS_CACHE) / "ftkit"
    assert len(list(cache.iterdir())) == 1
    assert train.cache_files and all(Path(f["filename"]).is_relative_to(cache) for f in train.cache_files)


# Batching ---------------------------------------------------------------------------------------------


def test_collator_pads_right_to_a_multiple_of_eight():
    batch = data.Collator(pad_id=0)(
        [
            {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
            {"input_ids": list(range(1, 11)), "labels": list(range(1, 11))},
        ]
    )
    assert batch["input_ids"].shape == (2, 16)
    assert batch["input_ids"][0].tolist() == [5, 6, 7] + [0] * 13
    assert batch["labels"][0].tolist() == [-100, 6, 7] + [-100] * 13
    assert batch["attention_mask"].sum(dim=1).tolist() == [3, 10]
    assert batch["attention_mask"][1].tolist() == [1] * 10 + [0] * 6
    assert all(t.dtype == torch.long for t in batch.values())


# Mistakes a user can make -----------------------------------------------------------------------------


def build_error(cfg: DataConfig, tokenizer) -> str:
    with pytest.raises(UserError) as caught:
        data.build_datasets(cfg, tokenizer, 0)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_malformed_jsonl_line_names_the_line(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": "broken"\n')
    assert build_error(config(str(path)), tokenizer).startswith(f"{path}:3: not valid JSON (")


def test_missing_field_names_the_line_and_field(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"}, {"instruction": "c"}])
    message = build_error(config(path, format="alpaca"), tokenizer)
    assert message == f"{path}:2: missing field 'output' (data.format alpaca)"
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user"}]}])
    assert (
        build_error(config(path), tokenizer)
        == f"{path}:1: messages[0]: missing field 'content' (data.format messages)"
    )


def test_csv_and_json_errors_name_the_record(tmp_path, tokenizer):
    (tmp_path / "d.csv").write_text("prompt,completion\nq,a\nq2\n")
    assert build_error(config(str(tmp_path / "d.csv")), tokenizer).startswith(
        f"{tmp_path / 'd.csv'}:3: missing field 'completion'"
    )
    (tmp_path / "d.json").write_text(json.dumps([{"text": "a"}, 5]))
    assert build_error(config(str(tmp_path / "d.json")), tokenizer).startswith(
        f"{tmp_path / 'd.json'}: record 2:"
    )


def test_empty_source_is_an_error(tmp_path, tokenizer):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    assert build_error(config(str(path)), tokenizer) == f"{path}: no records"
    blank = write_jsonl(tmp_path / "blank.jsonl", [{"text": "  "}])
    assert build_error(config(blank), tokenizer).startswith(
        f"{blank}: none of its 1 examples has a trained token"
    )


def test_every_label_masked_is_an_error_suggesting_a_longer_limit(tmp_path, tokenizer):
    records = [{"prompt": "What is two plus two? " * 5, "completion": "4"}] * 2
    path = write_jsonl(tmp_path / "d.jsonl", records)
    message = build_error(config(path, max_length=16), tokenizer)
    assert message.startswith(f"{path}: none of its 2 examples has a trained token left")
    assert "data.max_length=16; try a larger one" in message


def test_unknown_or_ambiguous_keys_list_keys_and_formats(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    message = build_error(config(path), tokenizer)
    assert message.startswith(
        f"{path}:1: keys [answer, question] matches no format; set data.format to one of:"
    )
    assert "alpaca (instruction, output)" in message and "prompt_completion (prompt, completion)" in message
    path = write_jsonl(tmp_path / "e.jsonl", [{"text": "t", "messages": []}])
    assert "matches several formats (messages, text)" in build_error(config(path), tokenizer)


def test_bad_role_is_an_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"conversations": [{"from": "bot", "value": "x"}]}])
    assert build_error(config(path), tokenizer).startswith(f"{path}:1: conversations[0]: 'from' is 'bot'")


def test_missing_file_is_not_looked_up_on_the_hub(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("hub lookup"))
    for name in ("missing.jsonl", str(tmp_path / "nope"), "./data/train", "data/sub/train"):
        assert build_error(config(name), tokenizer) == f"{name}: file not found"
    other = tmp_path / "d.txt"
    other.write_text("hello")
    assert "unsupported file type .txt" in build_error(config(str(other)), tokenizer)


def test_hub_failure_is_a_user_error(monkeypatch, tokenizer):
    def unreachable(name, split):
        raise ConnectionError("no network\nsecond line")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    assert build_error(config("someone/data"), tokenizer) == (
        "someone/data: not a local file, and datasets.load_dataset('someone/data', split='train') failed: "
        "no network"
    )


def test_bad_weights_and_empty_source_lists_are_errors(tmp_path, tokenizer):
    sources = [text_source(tmp_path, "sun", 2), text_source(tmp_path, "sea", 2)]
    assert build_error(config(sources, weights=[1, -1]), tokenizer).startswith("data.weights:")
    assert build_error(config([]), tokenizer) == "data.train: no training source given"


# The embedded assets, once built ----------------------------------------------------------------------

ASSETS = REPO / "toolkit" / "assets"


@pytest.mark.skipif(
    not (ASSETS / "tiny-llama" / "tokenizer_config.json").is_file()
    or not (ASSETS / "demo" / "train.jsonl").is_file(),
    reason="embedded assets not built",
)
def test_demo_data_with_the_embedded_tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")
    cfg = DataConfig(train=str(ASSETS / "demo" / "train.jsonl"), eval=str(ASSETS / "demo" / "eval.jsonl"))
    train, eval_set, stats = data.build_datasets(cfg, tokenizer, 0)
    assert len(train) > 0 and len(eval_set) > 0 and stats.label_tokens > 0
    first = json.loads((ASSETS / "demo" / "train.jsonl").read_text().splitlines()[0])["messages"]
    answers = [m["content"] + "<|im_end|>" for m in first if m["role"] == "assistant"]
    assert trained_runs(tokenizer, train[0]) == answers
