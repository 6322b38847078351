"""Greedy generation from token ids: prompts from chat text or from a tokenized row, answers, exact match."""

from __future__ import annotations

import torch

from toolkit.data.encode import IGNORE
from toolkit.model.speed import eager_blocks


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a one-turn user prompt ready for the assistant's answer."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def split_prompt(row: dict) -> tuple[list[int], list[int]] | None:
    """(prompt ids, reference answer ids) from a tokenized row: the first trained span is the answer."""
    labels = row["labels"]
    start = next((i for i, label in enumerate(labels) if label != IGNORE), None)
    if not start:
        return None
    end = next((i for i in range(start, len(labels)) if labels[i] == IGNORE), len(labels))
    return row["input_ids"][:start], row["input_ids"][start:end]


@torch.no_grad()
def greedy_answer(
    model,
    tokenizer,
    prompt_ids: list[int],
    max_new_tokens: int,
    synced: bool,
    images: dict | None = None,
    streamer=None,
) -> str:
    """Collective when `synced`: every rank must call it with the same prompt (sharded weights). `images`:
    a vision-language model's image inputs for the prompt's image tokens; `streamer`: transformers'
    streamer fed the tokens as they come (the studio's chat)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    pixels = {key: value.to(device) for key, value in (images or {}).items()}
    with eager_blocks():
        out = model.generate(
            **pixels,
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            synced_gpus=synced,
            streamer=streamer,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def exact_match(
    model, tokenizer, dataset, samples: int, max_new_tokens: int, synced: bool, images=None
) -> float:
    """Share of the first `samples` answerable rows whose greedy answer equals the reference. `images` (a
    vision-language model's data.ImageInputs) gives each row's image inputs."""
    rows = [dataset[i] for i in range(min(samples, len(dataset)))]
    cases = [(split_prompt(row), row.get("images")) for row in rows]
    hits = 0
    for pair, refs in cases:
        if pair is None:
            continue
        pixels = images.prompt_inputs(pair[0], refs, "an eval row") if images is not None and refs else None
        answer = greedy_answer(model, tokenizer, pair[0], max_new_tokens, synced, pixels)
        hits += answer == tokenizer.decode(pair[1], skip_special_tokens=True).strip()
    return hits / max(sum(pair is not None for pair, _ in cases), 1)
