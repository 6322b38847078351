"""KTO's rows: a prompt, one completion and whether it is desirable, read from TRL's unpaired layout
(`prompt`, `completion`, `label`) or split out of preference pairs (the chosen answer desirable, the
rejected one not).

A KTO row travels in the pair columns, so batching, the reference log-probs and their tables are the
pair machinery's: `chosen_ids` holds its completion, `rejected_ids` a mismatched completion (another
row's, after this row's prompt) whose log-ratio estimates the KL term, and `label` its flag."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import numpy as np

from toolkit.config import DataConfig
from toolkit.data.formats import tools_of
from toolkit.errors import UserError
from toolkit.preference.data import build_pairs, render_answer
from toolkit.preference.records import _turns, to_pair

UNPAIRED = ("prompt", "completion")
"""The unpaired layout's keys (with its `label`)."""


def to_rows(record: dict, layout: str, where: str) -> list[tuple[list[dict], list[dict], bool]]:
    """(prompt turns, completion turns, desirable) of each row in `record`: one for an unpaired record, two
    for a pair."""
    if layout != "unpaired":
        pair = to_pair(record, layout, where)
        return [(pair.prompt, pair.chosen, True), (pair.prompt, pair.rejected, False)]
    for key in UNPAIRED:
        if record.get(key) in (None, "", []):
            raise UserError(f"{where}: missing or empty '{key}'")
    if "label" not in record:
        raise UserError(
            f"{where}: missing 'label': say whether the completion is desirable (true) or not (false)"
        )
    if not isinstance(record["label"], bool):
        raise UserError(
            f"{where}: 'label' must be true (desirable) or false (undesirable), got {record['label']!r}"
        )
    prompt = _turns(record["prompt"], "prompt", "user", False, where)[0]
    completion = _turns(record["completion"], "completion", "assistant", False, where)[0]
    if completion[: len(prompt)] == prompt:  # a conversation given whole: the completion is what follows
        completion = completion[len(prompt) :]
    if not completion:
        raise UserError(f"{where}: 'completion' has no turn after the prompt")
    return [(prompt, completion, record["label"])]


@dataclass
class RowEncoder:
    """Encodes one chunk of records of a source in `layout` into KTO rows (see `encode_to_cache`)."""

    layout: str
    tokenizer: object
    max_length: int
    keep_prompt: int
    images: None = None
    """Rows are text (a vision-language model's KTO is refused before data is read)."""

    def __call__(self, chunk) -> tuple[dict[str, list], dict[str, int]]:
        columns = {"prompt_ids": [], "chosen_ids": [], "label": []}
        truncated = 0
        for i, record in enumerate(chunk.records()):
            where = chunk.where(i)
            for prompt, completion, label in to_rows(record, self.layout, where):
                texts = render_answer(self.tokenizer, prompt, completion, where, tools_of(record, where))
                prompt_ids, answer_ids = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
                if len(prompt_ids) + len(answer_ids) > self.max_length:
                    truncated += 1
                    prompt_ids = prompt_ids[-self.keep_prompt :]
                    answer_ids = answer_ids[: self.max_length - len(prompt_ids)]
                columns["prompt_ids"].append(prompt_ids)
                columns["chosen_ids"].append(answer_ids)
                columns["label"].append(label)
        return columns, {"truncated": truncated, "dropped": 0}


def build_rows(
    cfg: DataConfig,
    tokenizer,
    keep_prompt: int,
    seed: int,
    main_process_first=contextlib.nullcontext,
    images=None,
):
    """(train, eval or None, stats) as `build_pairs` gives pairs, each row with its mismatched completion;
    a train set of one kind is refused, and so are images (`images`: a vision-language model's)."""
    if images is not None:
        raise UserError("dpo.loss: kto reads text rows; model.path is a vision-language model")
    train, held, stats = build_pairs(
        cfg, tokenizer, keep_prompt, seed, main_process_first, encoder=RowEncoder
    )
    check_both_kinds(train, "data.train")
    train = with_mismatched(train, seed, cfg.max_length, "data.train")
    held = with_mismatched(held, seed, cfg.max_length, "data.eval") if held is not None else None
    return train, held, replace(stats, unit="rows")


def with_mismatched(dataset, seed: int, max_length: int, name: str):
    """`dataset` with each row's mismatched completion (`rejected_ids`): the completion of the row after it
    in a seeded random order of the rows, cut to fit after this row's prompt."""
    if len(dataset) < 2:
        raise UserError(
            f"{name}: KTO needs 2 rows or more (its KL term scores a row's completion after another's prompt)"
        )
    order = np.random.default_rng(seed).permutation(len(dataset))
    source = np.empty_like(order)
    source[order] = np.roll(order, -1)
    completions = dataset["chosen_ids"]
    prompts = dataset["prompt_ids"]
    mismatched = [completions[j][: max_length - len(prompts[i])] for i, j in enumerate(source.tolist())]
    return dataset.add_column("rejected_ids", mismatched)


def check_both_kinds(dataset, name: str) -> None:
    """Refuse a set whose rows are all desirable or all undesirable: KTO weighs one kind against the other."""
    desirable = sum(dataset["label"])
    if desirable in (0, len(dataset)):
        kind = "desirable" if desirable else "undesirable"
        raise UserError(f"{name}: all {len(dataset)} rows are {kind}; KTO needs rows of both kinds")
