"""Train/serve agreement: the prompt a chat template renders for generation should be the opening of the
text the model was trained on, or the model answers after text it never saw in training (templates that
drop earlier reasoning at inference but keep it in training are the common case)."""

from __future__ import annotations

from toolkit.data.chat import render
from toolkit.data.formats import text_only, to_example

SAMPLE = 8
SHOWN = 30


def disagreement(tokenizer, record: dict, fmt: str, where: str, images: bool = False) -> str | None:
    """None when generating each assistant turn of the record starts from its training text's prefix,
    else one line with the first differing characters. A row with images is refused unless `images` (the
    model is a vision-language one)."""
    example = to_example(record, fmt, where)
    if not images:
        text_only(example, where)
    messages, tools = example.get("messages") or [], example.get("tools")
    text = None
    for turn, message in enumerate(messages):
        if message["role"] != "assistant" or turn == 0:
            continue
        text = text or render(tokenizer, messages, where, tools=tools)
        prompt = render(tokenizer, messages[:turn], where, generation_prompt=True, tools=tools)
        if not text.startswith(prompt):
            at = next((i for i, (a, b) in enumerate(zip(text, prompt, strict=False)) if a != b), len(text))
            return (
                f"{where}: message {turn}: the chat template's generation prompt differs from the training "
                f"text at character {at}: trained {text[at : at + SHOWN]!r}, "
                f"served {prompt[at : at + SHOWN]!r}"
            )
    return None


def first_disagreement(tokenizer, source, fmt: str, images: bool = False) -> str | None:
    """The first disagreement among the opening records of `source`, or None (`images`: as `disagreement`)."""
    if fmt == "text":
        return None
    for chunk in source.read(SAMPLE):
        for i, record in enumerate(chunk.records()):
            found = disagreement(tokenizer, record, fmt, chunk.where(i), images)
            if found:
                return found
        return None
    return None
