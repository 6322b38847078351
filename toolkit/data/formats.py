"""Record layouts: detect which one a source uses and turn each record into either a conversation
({"messages": [{role, content}, ...]}) or plain text ({"text": ...})."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import UserError

FORMAT_KEYS = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
}
ROLES = ("system", "user", "assistant")


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
        {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"},
    ),
}


def detect_format(record: dict, where: str) -> str:
    """The one format whose keys the record has; zero or several matches is an error listing both sides."""
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
        return {"messages": _conversation(record, fmt, where)}
    if fmt == "alpaca":
        instruction = _text(record, "instruction", fmt, where)
        extra = record.get("input")
        if extra is not None and not isinstance(extra, str):
            raise UserError(f"{where}: field 'input' must be text, got {type(extra).__name__}")
        prompt = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
        return {"messages": _turns(prompt, _text(record, "output", fmt, where))}
    if fmt == "prompt_completion":
        return {
            "messages": _turns(_text(record, "prompt", fmt, where), _text(record, "completion", fmt, where))
        }
    raise ValueError(f"unknown format {fmt!r}")


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


def _conversation(record: dict, fmt: str, where: str) -> list[dict]:
    fields = CONVERSATIONS[fmt]
    messages = []
    for i, turn in enumerate(_list(record, fields.turns, fmt, where)):
        here = f"{where}: {fields.turns}[{i}]"
        if not isinstance(turn, dict):
            raise UserError(
                f"{here} must be an object with {fields.speaker} and {fields.text}, got {type(turn).__name__}"
            )
        speaker = _text(turn, fields.speaker, fmt, here)
        if speaker not in fields.roles:
            raise UserError(
                f"{here}: '{fields.speaker}' is {speaker!r}, not one of {', '.join(fields.roles)}"
            )
        messages.append({"role": fields.roles[speaker], "content": _text(turn, fields.text, fmt, here)})
    return messages
