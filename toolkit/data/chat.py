"""Chat templates: a ChatML fallback, rendering, and locating each trained assistant turn in the text.

Assistant turns are located by rendering, not by searching for their words: a turn spans from the end of
the prompt rendered up to it (with the generation prompt) to the end of the conversation rendered through
it. That works for any template, whatever form it writes tool calls or reasoning in, as long as the
template is prefix-stable: rendering a conversation's opening turns gives the opening of its full text.
"""

from __future__ import annotations

import logging
import re

import jinja2

from toolkit.errors import UserError

logger = logging.getLogger(__name__)

# The fallback's documented form (docs/data.md, "Tool calls in the ChatML fallback, and the tools demo"):
# tools are listed in the system turn one JSON schema a line inside <tools>; an assistant turn writes its
# reasoning inside <think>, its text, then each call as {"name", "arguments"} JSON inside <tool_call>; a
# tool result is a `tool` turn inside <tool_response>. Turns close with the tokenizer's own eos token, so a
# base model learns to emit the token that already stops generation; no token is added and the embeddings
# need no resizing.
CHATML_EOS = """
{%- set rest = messages %}
{%- if tools %}
  {{- '<|im_start|>system\\n' }}
  {%- if messages and messages[0]['role'] == 'system' %}
    {{- messages[0]['content'] + '\\n\\n' }}{%- set rest = messages[1:] %}
  {%- endif %}
  {{- '# Tools\\n<tools>\\n' }}
  {%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}
  {{- '</tools>' + eos_token + '\\n' }}
{%- endif %}
{%- for message in rest %}
  {{- '<|im_start|>' + message['role'] + '\\n' }}
  {%- if message['role'] == 'assistant' %}
    {%- generation %}
    {%- if message.get('reasoning_content') %}
      {{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n' }}
    {%- endif %}
    {{- message['content'] or '' }}
    {%- for call in message.get('tool_calls') or [] %}
      {%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}
      {%- set body = {'name': call['function']['name'], 'arguments': call['function']['arguments']} %}
      {{- '<tool_call>\\n' + body | tojson + '\\n</tool_call>' }}
    {%- endfor %}
    {{- eos_token }}
    {%- endgeneration %}
    {{- '\\n' }}
  {%- elif message['role'] == 'tool' %}
    {{- '<tool_response>\\n' + message['content'] + '\\n</tool_response>' + eos_token + '\\n' }}
  {%- else %}
    {{- message['content'] + eos_token + '\\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
PROBE = [
    {"role": "system", "content": "ftkit probe system"},
    {"role": "user", "content": "ftkit probe question"},
    {"role": "assistant", "content": "ftkit probe answer"},
]
# A reasoning block with nothing in it, as templates insert before an answer given without reasoning.
EMPTY_THINKING = re.compile(r"\s*<think>\s*</think>\s*")
CLOSING_TAG = re.compile(r"\s*</[A-Za-z_]+>\s*")


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


def render(
    tokenizer, messages: list[dict], where: str, generation_prompt: bool = False, tools: list | None = None
) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )
    except jinja2.TemplateError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{where}: the chat template rejected this conversation ({reason})") from None


def check_prefix_stable(tokenizer) -> None:
    """One line naming the template's problem when a plain probe conversation cannot have its assistant
    turn located by rendering. What only some conversations show (tool turns, a template dropping earlier
    reasoning once a later user turn follows) is caught per conversation, naming its line."""
    assistant_spans(tokenizer, PROBE, "chat template check")


def assistant_spans(
    tokenizer, messages: list[dict], where: str, tools: list | None = None, train_reasoning: bool = True
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of every trained assistant turn
    (its reasoning, text, tool calls and end-of-turn text; trailing whitespace excluded)."""
    text = render(tokenizer, messages, where, tools=tools)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or message.get("train") is False:
            continue
        head = render(tokenizer, messages[:i], where, generation_prompt=True, tools=tools)
        through = render(tokenizer, messages[: i + 1], where, tools=tools)
        if not through.startswith(head) or not text.startswith(through):
            problem = (
                "its generation prompt is not how it opens this assistant turn"
                if not through.startswith(head)
                else "it renders this turn differently once later turns follow, e.g. drops its reasoning"
            )
            raise UserError(
                f"{where}: message {i}: the chat template is not prefix-stable ({problem}), so assistant "
                "turns cannot be located; set data.assistant_only_loss: false or fix the template"
            )
        start, end = len(head), len(through.rstrip())
        _check_calls_written(text[start:end], message, i, where)
        spans.append((_trained_start(text, start, end, message, train_reasoning), end))
    return text, spans


def _check_calls_written(turn: str, message: dict, index: int, where: str) -> None:
    """A template that ignores `tool_calls` would train the turn as empty text."""
    for call in message.get("tool_calls") or []:
        if call["function"]["name"] not in turn:
            raise UserError(
                f"{where}: message {index}: the chat template does not write tool calls "
                f"({call['function']['name']!r} is missing from the turn); use a template that renders "
                "tool_calls"
            )


def _trained_start(text: str, start: int, end: int, message: dict, train_reasoning: bool) -> int:
    """Skip an empty thinking block the template wrote by itself, or the reasoning when it is not trained."""
    reasoning = message.get("reasoning_content")
    if not reasoning:
        empty = EMPTY_THINKING.match(text, start, end)
        return empty.end() if empty else start
    if train_reasoning:
        return start
    position = text.find(reasoning, start, end)
    if position < 0:
        return start
    after = position + len(reasoning)
    closing = CLOSING_TAG.match(text, after, end)
    return closing.end() if closing else after
