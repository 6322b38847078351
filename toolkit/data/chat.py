"""Chat templates: a ChatML fallback, rendering, and locating each assistant turn in the rendered text.

Assistant turns are located by character position rather than by template-specific markers, so any
template works as long as it writes each assistant message's content verbatim (or stripped) followed by
the same closing text (its end-of-turn token) that it writes after a final assistant message.
"""

from __future__ import annotations

import logging

import jinja2

from toolkit.errors import UserError

logger = logging.getLogger(__name__)

# Turns close with the tokenizer's own eos token, so a base model learns to emit the token that already
# stops generation; no new token is added and the embeddings need no resizing.
CHATML_EOS = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PROBE = "ftkit probe answer 7f3a"


def ensure_chat_template(tokenizer) -> bool:
    """Give a tokenizer without a chat template a ChatML one; True (and one warning) when it had to."""
    if tokenizer.chat_template:
        return False
    if tokenizer.eos_token is None:
        raise UserError(
            "the tokenizer has no chat template and no eos token to end turns with; "
            "use a model with a chat template or data.format: text"
        )
    tokenizer.chat_template = CHATML_EOS
    logger.warning(
        "the tokenizer has no chat template; using ChatML with %s ending each turn", tokenizer.eos_token
    )
    return True


def render(tokenizer, messages: list[dict], where: str, generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    except jinja2.TemplateError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{where}: the chat template rejected this conversation ({reason})") from None


def turn_closing(tokenizer) -> str:
    """What the template writes after an assistant message's content, e.g. "<|im_end|>" (trailing
    whitespace excluded): trained with the content so the model learns to stop."""
    conversation = [{"role": "user", "content": "?"}, {"role": "assistant", "content": PROBE}]
    text = render(tokenizer, conversation, "chat template")
    if PROBE not in text:
        raise UserError(
            "the chat template does not write assistant messages verbatim, so their tokens cannot "
            "be located; set data.assistant_only_loss: false"
        )
    return text[text.rindex(PROBE) + len(PROBE) :].rstrip()


def assistant_spans(
    tokenizer, messages: list[dict], closing: str, where: str
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of every assistant turn
    (content + closing)."""
    text = render(tokenizer, messages, where)
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = cursor
        if i > 0:
            # The prompt up to this turn bounds the search, so an earlier user turn that happens to end with
            # the same words is never mistaken for it. Templates that move text between turns (a system
            # prompt placed before the last user turn) fall back to searching after the previous answer.
            head = render(tokenizer, messages[:i], where, generation_prompt=True)
            start = len(head) if text.startswith(head) else cursor
        span = _find_turn(text, message["content"], closing, start)
        if span is None:
            raise UserError(
                f"{where}: assistant message {i} followed by {closing!r} was not found in the "
                "rendered chat template; set data.assistant_only_loss: false for this template"
            )
        spans.append(span)
        cursor = span[1]
    return text, spans


def _find_turn(text: str, content: str, closing: str, start: int) -> tuple[int, int] | None:
    # Some templates trim message content (Llama 3 does), so try the stripped form too.
    for body in (content + closing, content.strip() + closing):
        position = text.find(body, start)
        if position >= 0:
            return position, position + len(body)
    return None
