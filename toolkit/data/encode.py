"""Records to training rows: token ids plus labels (IGNORE where no loss is taken), truncated to the
length limit, with rows that train nothing left out and counted."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from toolkit.data.chat import assistant_spans, render, turn_closing
from toolkit.data.formats import to_example
from toolkit.data.sources import Source
from toolkit.errors import UserError

# The label of a token no loss is taken on (the value torch's cross entropy skips by default).
IGNORE = -100

# Examples tokenized per call: the Rust tokenizer spreads a batch over all cores.
CHUNK = 1000


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


def encode_source(source: Source, fmt: str, tokenizer, max_length: int, assistant_only_loss: bool) -> Encoded:
    """Plain text trains every token (eos appended so documents end); a conversation is rendered through
    the chat template and trains either every token or, with `assistant_only_loss`, only the tokens that
    overlap an assistant turn's characters (its content and closing end-of-turn text)."""
    masked = assistant_only_loss and fmt != "text"
    if masked and not getattr(tokenizer, "is_fast", False):
        raise UserError(
            "data.assistant_only_loss needs a fast tokenizer (character offsets); "
            "this one is not, so set data.assistant_only_loss: false"
        )
    closing = turn_closing(tokenizer) if masked else ""
    out = Encoded()
    for begin in range(0, len(source.records), CHUNK):
        indices = range(begin, min(begin + CHUNK, len(source.records)))
        rendered = [
            _render(source.records[i], fmt, tokenizer, masked, closing, source.where(i)) for i in indices
        ]
        texts = [text for text, _ in rendered]
        # Chat templates write any bos/eos the model expects; adding them again would double them.
        encoding = tokenizer(texts, add_special_tokens=fmt == "text", return_offsets_mapping=masked)
        for i, (text, spans) in enumerate(rendered):
            ids = encoding["input_ids"][i] if text.strip() else []
            if fmt == "text":
                ids = _with_eos(ids, tokenizer.eos_token_id)
            labels = _mask(ids, encoding["offset_mapping"][i], spans) if masked else list(ids)
            out.add(ids, labels, max_length)
    return out


def _render(record: dict, fmt: str, tokenizer, masked: bool, closing: str, where: str):
    """(text, assistant character spans or None) for one record."""
    example = to_example(record, fmt, where)
    if "text" in example:
        return example["text"], None
    if not example["messages"]:
        return "", []
    if masked:
        return assistant_spans(tokenizer, example["messages"], closing, where)
    return render(tokenizer, example["messages"], where), None


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
