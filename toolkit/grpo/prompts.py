"""Prompts from the rows the SFT data layouts encode: a row's last assistant turn is its reference answer
and everything before it the prompt; which prompts each generation round samples, seeded."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from toolkit.data.encode import IGNORE


@dataclass
class PromptSet:
    ids: list[list[int]]
    """Token ids of each prompt, ready for the assistant's answer."""
    answers: list[str]
    """Each prompt's reference answer as text (what `exact_answer` compares with)."""
    texts: list[str]
    """Each prompt as text (what a user's reward function receives)."""

    def __len__(self) -> int:
        return len(self.ids)


def last_turn(row: dict) -> tuple[list[int], list[int]] | None:
    """(prompt ids, answer ids): the answer is the last run of trained tokens; None when there is none or
    nothing precedes it."""
    labels = row["labels"]
    end = next((i + 1 for i in range(len(labels) - 1, -1, -1) if labels[i] != IGNORE), None)
    if end is None:
        return None
    start = end
    while start > 0 and labels[start - 1] != IGNORE:
        start -= 1
    return (row["input_ids"][:start], row["input_ids"][start:end]) if start else None


def first_prompt(row: dict, turn: tuple[list[int], list[int]]) -> list[int]:
    """The ids before the row's first trained token: a conversation's opening, before the model's first
    turn (its tool calls and their results, in the data, come after it)."""
    first = next(i for i, label in enumerate(row["labels"]) if label != IGNORE)
    return list(row["input_ids"][:first]) if first else list(turn[0])


def prompt_set(dataset, tokenizer, opening: bool = False) -> PromptSet:
    """Every row of `dataset` that has a prompt and an answer; `opening`: the prompt is what precedes the
    first assistant turn (multi-turn rollouts), else the last."""
    ids, answers, texts = [], [], []
    for row in dataset:
        turn = last_turn(row)
        if turn is None:
            continue
        if opening:
            turn = (first_prompt(row, turn), turn[1])
        ids.append(list(turn[0]))
        answers.append(tokenizer.decode(turn[1], skip_special_tokens=True).strip())
        texts.append(tokenizer.decode(turn[0], skip_special_tokens=True))
    return PromptSet(ids, answers, texts)


def round_prompts(count: int, per_round: int, round_index: int, seed: int) -> list[int]:
    """Indices of the prompts round `round_index` samples: consecutive slices of one seeded permutation
    per pass over the prompts, so every prompt is used once before any is used again."""
    orders, picked = {}, []
    for slot in range(round_index * per_round, (round_index + 1) * per_round):
        epoch, position = divmod(slot, count)
        if epoch not in orders:
            orders[epoch] = np.random.default_rng([seed, epoch]).permutation(count)
        picked.append(int(orders[epoch][position]))
    return picked
