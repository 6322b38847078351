"""Scores of answers by a reward model, encoded as its training pairs were: the prompt rendered through
the chat template up to the assistant header, the answer after it, tokenized apart; used by `ftkit score`
and by GRPO's reward-model reward."""

from __future__ import annotations

import torch

from toolkit.preference.data import render_answer
from toolkit.reward.loss import batch_rewards


def answer_ids(tokenizer, prompt: list[dict], answer: str, where: str) -> list[int]:
    """Token ids of `answer` (one assistant turn) after the conversation `prompt`."""
    texts = render_answer(tokenizer, prompt, [{"role": "assistant", "content": answer}], where)
    prompt_ids, reply_ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return prompt_ids + reply_ids


@torch.no_grad()
def score_rows(model, rows: list[list[int]], pad_id: int, device=None) -> list[float]:
    """The reward of each row of token ids, in one right-padded batch."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    batch = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    return batch_rewards(model, batch).tolist()
