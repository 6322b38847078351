"""Records to training rows: token ids plus labels (IGNORE where no loss is taken), truncated to the
length limit, with rows that train nothing left out and counted."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from toolkit.data.chat import assistant_spans, check_prefix_stable, render
from toolkit.data.formats import text_only, to_example
from toolkit.data.sources import Chunk
from toolkit.errors import UserError

# The label of a token no loss is taken on (the value torch's cross entropy skips by default).
IGNORE = -100


@dataclass
class Encoded:
    input_ids: list[list[int]] = field(default_factory=list)
    labels: list[list[int]] = field(default_factory=list)
    truncated: int = 0
    """Examples longer than the limit, cut to it."""
    dropped: int = 0
    """Examples with no trained token: empty, without an assistant turn, or cut off before it."""

    def add(self, ids: list[int], labels: list[int], max_length: int) -> None:
        if len(ids) > max_length:
            self.truncated += 1
            ids, labels = ids[:max_length], labels[:max_length]
        if all(label == IGNORE for label in labels):
            self.dropped += 1
            return
        self.input_ids.append(ids)
        self.labels.append(labels)


def check_encoder(tokenizer, fmt: str, assistant_only_loss: bool) -> None:
    if assistant_only_loss and fmt != "text" and not getattr(tokenizer, "is_fast", False):
        raise UserError(
            "data.assistant_only_loss needs a fast tokenizer (character offsets); "
            "this one is not, so set data.assistant_only_loss: false"
        )


@dataclass
class ChunkEncoder:
    """Encodes one chunk of records into rows. Plain text trains every token (eos appended so documents
    end); a conversation is rendered through the chat template and trains either every token or, with
    `assistant_only_loss`, only the tokens that overlap an assistant turn's characters (its reasoning,
    text, tool calls and end-of-turn text; see `chat.assistant_spans`). An object rather than a closure
    so worker processes can receive it."""

    fmt: str
    tokenizer: object
    max_length: int
    assistant_only_loss: bool
    train_reasoning: bool = True

    def __call__(self, chunk: Chunk) -> tuple[dict[str, list], dict[str, int]]:
        """(columns, counts) for the rows of `chunk`: see `encode_to_cache`."""
        fmt, tokenizer = self.fmt, self.tokenizer
        masked = self.assistant_only_loss and fmt != "text"
        if masked:
            check_prefix_stable(tokenizer)
        records = chunk.records()
        rendered = [
            _render(r, fmt, tokenizer, masked, self.train_reasoning, chunk.where(i))
            for i, r in enumerate(records)
        ]
        texts = [text for text, _ in rendered]
        # Chat templates write any bos/eos the model expects; adding them again would double them.
        encoding = tokenizer(texts, add_special_tokens=fmt == "text", return_offsets_mapping=masked)
        out = Encoded()
        for i, (text, spans) in enumerate(rendered):
            ids = encoding["input_ids"][i] if text.strip() else []
            if fmt == "text":
                ids = _with_eos(ids, tokenizer.eos_token_id)
            labels = _mask(ids, encoding["offset_mapping"][i], spans) if masked else list(ids)
            out.add(ids, labels, self.max_length)
        columns = {"input_ids": out.input_ids, "labels": out.labels}
        return columns, {"truncated": out.truncated, "dropped": out.dropped}


def _render(record: dict, fmt: str, tokenizer, masked: bool, train_reasoning: bool, where: str):
    """(text, assistant character spans or None) for one record."""
    example = text_only(to_example(record, fmt, where), where)
    if "text" in example:
        return example["text"], None
    if not example["messages"]:
        return "", []
    messages, tools = example["messages"], example["tools"]
    if masked:
        return assistant_spans(tokenizer, messages, where, tools=tools, train_reasoning=train_reasoning)
    return render(tokenizer, messages, where, tools=tools), None


def _with_eos(ids: list[int], eos: int | None) -> list[int]:
    if not ids or eos is None or ids[-1] == eos:
        return ids
    return ids + [eos]


def _mask(ids: list[int], offsets: list, spans: list[tuple[int, int]]) -> list[int]:
    """`ids` where the token's characters overlap a span, IGNORE elsewhere."""
    if not ids:
        return []
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    trained = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        trained |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    return np.where(trained, ids, IGNORE).tolist()
