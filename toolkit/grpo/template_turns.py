"""What a chat template writes after the model's turn: the environment's turns (tool results, a user turn)
and the header of the model's next turn, as token ids to append to a conversation. Shared by the tools'
conversations (multiturn.py) and OpenEnv's (openenv.py)."""

from __future__ import annotations

from toolkit.errors import UserError

# A stand-in for the conversation before the model's turn: what the template writes after an assistant turn
# does not depend on it.
OPENING = [{"role": "user", "content": "?"}]
TOOL_CALL_CLOSE = "</tool_call>"
LLAMA3_END_OF_MESSAGE = "<|eom_id|>"


def appended(
    tokenizer, assistant: dict, following: list[dict], schemas=None, at_close: bool = False
) -> list[int]:
    """Token ids of what the chat template writes after the model's turn `assistant`: the `following`
    turns and the header of the model's next turn; `at_close`: the turn ended at its tool call's close, so
    what the template writes after that close (its end of turn) comes first."""
    through = _render(tokenizer, [*OPENING, assistant], schemas, False).rstrip()
    full = _render(tokenizer, [*OPENING, assistant, *following], schemas, True)
    if not full.startswith(through):
        raise UserError(
            "grpo.environment: the chat template renders an assistant turn differently once the "
            "environment's turns follow (not prefix-stable), so they cannot be appended to the model's"
        )
    close = through.rfind(TOOL_CALL_CLOSE)
    tail = through[close + len(TOOL_CALL_CLOSE) :] if at_close and close >= 0 else ""
    return tokenizer(tail + full[len(through) :], add_special_tokens=False)["input_ids"]


def _render(tokenizer, messages, schemas, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=schemas, tokenize=False, add_generation_prompt=generation_prompt
    )
