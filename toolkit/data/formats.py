"""Record layouts: detect which one a source uses and turn each record into either a conversation
({"messages": [...], "tools": [...] or None}) or plain text ({"text": ...}).

A conversation's messages are normalised to the OpenAI/Hugging Face form every chat template reads: a
role (system, user, assistant, tool), text content, and where present `tool_calls` (each
{"type": "function", "function": {"name", "arguments": dict}}), `tool_call_id`, `name` and
`reasoning_content`. A message with `train: false` (or `weight: 0`) keeps `train: False` and is not trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from toolkit.errors import UserError

FORMAT_KEYS = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
}
ROLES = ("system", "user", "assistant", "tool")
PAIR_KEYS = ("chosen", "rejected")


@dataclass(frozen=True)
class TurnFields:
    """Where a conversation layout keeps its turns: the list, each turn's speaker and text, and the speaker
    names it accepts with the chat role each stands for."""

    turns: str
    speaker: str
    text: str
    roles: dict[str, str]


CONVERSATIONS = {
    "messages": TurnFields("messages", "role", "content", {role: role for role in ROLES}),
    "sharegpt": TurnFields(
        "conversations",
        "from",
        "value",
        {
            "system": "system",
            "human": "user",
            "user": "user",
            "gpt": "assistant",
            "assistant": "assistant",
            "function_call": "assistant",
            "observation": "tool",
            "tool": "tool",
        },
    ),
}


def detect_format(record: dict, where: str) -> str:
    """The one format whose keys the record has; zero or several matches is an error listing both sides."""
    if all(key in record for key in PAIR_KEYS):
        raise UserError(
            f"{where}: keys [{', '.join(sorted(record))}] are preference pairs (chosen, rejected); "
            "train them with recipes/dpo_llm.py, not the SFT recipe"
        )
    matches = [fmt for fmt, keys in FORMAT_KEYS.items() if all(key in record for key in keys)]
    if len(matches) == 1:
        return matches[0]
    found = ", ".join(sorted(record)) or "none"
    accepted = "; ".join(f"{fmt} ({', '.join(keys)})" for fmt, keys in FORMAT_KEYS.items())
    problem = f"matches several formats ({', '.join(matches)})" if matches else "matches no format"
    raise UserError(f"{where}: keys [{found}] {problem}; set data.format to one of: {accepted}")


def to_example(record: dict, fmt: str, where: str) -> dict:
    """Alpaca's user turn is the instruction, then a blank line and the input when there is one."""
    if fmt == "text":
        return {"text": _text(record, "text", fmt, where)}
    if fmt in CONVERSATIONS:
        messages = _system(record, where) + _conversation(record, fmt, where)
        return {"messages": messages, "tools": tools_of(record, where)}
    if fmt == "alpaca":
        return {"messages": _alpaca(record, where), "tools": None}
    if fmt == "prompt_completion":
        prompt, completion = _text(record, "prompt", fmt, where), _text(record, "completion", fmt, where)
        return {"messages": _turns(prompt, completion), "tools": None}
    raise ValueError(f"unknown format {fmt!r}")


def tools_of(record: dict, where: str) -> list[dict] | None:
    """The record's `tools` column: a list of JSON schemas, or a JSON string of one (LLaMA-Factory)."""
    tools = record.get("tools")
    if tools in (None, "", []):
        return None
    if isinstance(tools, str):
        tools = _json(tools, "tools", where)
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise UserError(f"{where}: field 'tools' must be a list of JSON schemas, got {type(tools).__name__}")
    return tools


def _alpaca(record: dict, where: str) -> list[dict]:
    instruction = _text(record, "instruction", "alpaca", where)
    extra = record.get("input")
    if extra is not None and not isinstance(extra, str):
        raise UserError(f"{where}: field 'input' must be text, got {type(extra).__name__}")
    prompt = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
    history = record.get("history") or []
    if not isinstance(history, list):
        raise UserError(f"{where}: field 'history' must be a list of [instruction, output] pairs")
    earlier = []
    for i, pair in enumerate(history):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise UserError(f"{where}: history[{i}] must be a pair of texts [instruction, output]")
        earlier += _turns(*pair)
    return _system(record, where) + earlier + _turns(prompt, _text(record, "output", "alpaca", where))


def _system(record: dict, where: str) -> list[dict]:
    system = record.get("system")
    if system in (None, ""):
        return []
    if not isinstance(system, str):
        raise UserError(f"{where}: field 'system' must be text, got {type(system).__name__}")
    return [{"role": "system", "content": system}]


def _turns(user: str, assistant: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def _field(record: dict, key: str, fmt: str, where: str):
    value = record.get(key)
    if value is None:
        raise UserError(f"{where}: missing field '{key}' (data.format {fmt})")
    return value


def _text(record: dict, key: str, fmt: str, where: str) -> str:
    value = _field(record, key, fmt, where)
    if not isinstance(value, str):
        raise UserError(f"{where}: field '{key}' must be text, got {type(value).__name__}")
    return value


def _list(record: dict, key: str, fmt: str, where: str) -> list:
    value = _field(record, key, fmt, where)
    if not isinstance(value, list):
        raise UserError(f"{where}: field '{key}' must be a list of turns, got {type(value).__name__}")
    return value


def _json(text: str, key: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{where}: field '{key}' is not valid JSON ({exc.msg} at character {exc.pos})"
        ) from None


def _conversation(record: dict, fmt: str, where: str) -> list[dict]:
    fields = CONVERSATIONS[fmt]
    return turns_to_messages(_list(record, fields.turns, fmt, where), fmt, fields.turns, where)


def turns_to_messages(turns: list, fmt: str, key: str, where: str) -> list[dict]:
    """The turns of a `messages` or `sharegpt` list (field `key` of the record) as normalised messages."""
    fields = CONVERSATIONS[fmt]
    messages = []
    for i, turn in enumerate(turns):
        here = f"{where}: {key}[{i}]"
        if not isinstance(turn, dict):
            raise UserError(
                f"{here} must be an object with {fields.speaker} and {fields.text}, got {type(turn).__name__}"
            )
        speaker = _text(turn, fields.speaker, fmt, here)
        if speaker not in fields.roles:
            raise UserError(
                f"{here}: '{fields.speaker}' is {speaker!r}, not one of {', '.join(fields.roles)}"
            )
        if speaker == "function_call":
            message = {"role": "assistant", "content": "", "tool_calls": _calls(turn.get(fields.text), here)}
        else:
            message = _message(turn, fields, fields.roles[speaker], fmt, here)
        if turn.get("train") is False or turn.get("weight") in (0, 0.0):
            message["train"] = False
        messages.append(message)
    return messages


def _message(turn: dict, fields: TurnFields, role: str, fmt: str, where: str) -> dict:
    calls = turn.get("tool_calls")
    content = turn.get(fields.text)
    if content is None and not calls:
        raise UserError(f"{where}: missing field '{fields.text}' (data.format {fmt})")
    message = {"role": role, "content": _content(content, fields.text, where)}
    if calls:
        if role != "assistant":
            raise UserError(f"{where}: field 'tool_calls' is only for assistant turns, not {role}")
        message["tool_calls"] = _calls(calls, where)
    for key in ("tool_call_id", "name", "reasoning_content"):
        value = turn.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise UserError(f"{where}: field '{key}' must be text, got {type(value).__name__}")
            message[key] = value
    return message


def _content(content, key: str, where: str) -> str:
    """Text, or a list of text parts ([{"type": "text", "text": ...}]) joined into one text."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise UserError(
            f"{where}: field '{key}' must be text or a list of text parts, got {type(content).__name__}"
        )
    parts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise UserError(f"{where}: field '{key}'[{j}] is a {kind!r} part; only text parts are read")
        parts.append(part["text"])
    return "".join(parts)


def _calls(calls, where: str) -> list[dict]:
    """Tool calls as [{"type": "function", "function": {"name", "arguments": dict}}]; a JSON string (as
    sharegpt's function_call turn holds) or a bare {"name", "arguments"} object is read too."""
    if isinstance(calls, str):
        calls = _json(calls, "tool_calls", where)
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise UserError(f"{where}: field 'tool_calls' must be a list of calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise UserError(f"{where}: tool_calls[{j}] has no function name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            arguments = _json(arguments, f"tool_calls[{j}].arguments", where)
        if not isinstance(arguments, dict):
            raise UserError(f"{where}: tool_calls[{j}].arguments must be a JSON object")
        entry = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out
