"""Record layouts: detect which one a source uses and turn each record into either a conversation
({"messages": [...], "tools": [...] or None, "images": [ref, ...]}) or plain text ({"text": ...}).

A conversation's messages are normalised to the OpenAI/Hugging Face form every chat template reads: a
role (system, user, assistant, tool), text content, and where present `tool_calls` (each
{"type": "function", "function": {"name", "arguments": dict}}), `tool_call_id`, `name` and
`reasoning_content`. A message with `train: false` (or `weight: 0`) keeps `train: False` and is not trained.

Content is a string, except in a message holding images: there it is a list of {"type": "text", "text"}
and {"type": "image"} parts in order, and the example's `images` lists one reference per image part over
the whole conversation, as the record gave it (a path or URL; `images.resolve_image` resolves it). Images
come as OpenAI/Hugging Face content parts with their own source, as bare {"type": "image"} parts (TRL), or
as `<image>` placeholders in the text (LLaMA-Factory, LLaVA), the last two matched in order with the
record's `images` (or LLaVA's `image`) column.
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
IMAGE_COLUMNS = ("images", "image")
IMAGE_PLACEHOLDER = "<image>"
# Where each kind of image part keeps its source; a bare "image" part has none and takes the column's next.
IMAGE_SOURCES = {"image": ("image", "url", "path"), "image_url": ("image_url",)}
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
        system = _system(record, where)
        messages, images = _conversation(record, fmt, where)
        return {"messages": system + messages, "tools": tools_of(record, where), "images": images}
    _no_images(record, fmt, where)
    if fmt == "alpaca":
        return {"messages": _alpaca(record, where), "tools": None, "images": []}
    if fmt == "prompt_completion":
        prompt, completion = _text(record, "prompt", fmt, where), _text(record, "completion", fmt, where)
        return {"messages": _turns(prompt, completion), "tools": None, "images": []}
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


def _conversation(record: dict, fmt: str, where: str) -> tuple[list[dict], list[str]]:
    """(messages, image references). `<image>` in text is a placeholder only in a record with an image
    column: without one the row is text and stays exactly as written."""
    fields = CONVERSATIONS[fmt]
    turns = _list(record, fields.turns, fmt, where)
    column = _image_column(record, where)
    messages, sources = _read_turns(turns, fmt, fields.turns, where, placeholders=column is not None)
    return messages, _match_images(sources, column or [], where)


def _read_turns(
    turns: list, fmt: str, key: str, where: str, placeholders: bool
) -> tuple[list[dict], list[str | None]]:
    """(messages, one source per image part in order: the part's own, or None where the column gives it)."""
    fields = CONVERSATIONS[fmt]
    messages, sources = [], []
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
            message, found = _message(turn, fields, fields.roles[speaker], fmt, here, placeholders)
            sources += found
        if turn.get("train") is False or turn.get("weight") in (0, 0.0):
            message["train"] = False
        messages.append(message)
    return messages, sources


def _message(
    turn: dict, fields: TurnFields, role: str, fmt: str, where: str, placeholders: bool
) -> tuple[dict, list[str | None]]:
    calls = turn.get("tool_calls")
    content = turn.get(fields.text)
    if content is None and not calls:
        raise UserError(f"{where}: missing field '{fields.text}' (data.format {fmt})")
    content, sources = _content(content, fields.text, where, placeholders)
    if sources and role == "assistant":
        raise UserError(f"{where}: images in an assistant turn are not trained; put them in a user turn")
    message = {"role": role, "content": content}
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
    return message, sources


def _content(content, key: str, where: str, placeholders: bool) -> tuple[str | list[dict], list[str | None]]:
    """(content, image sources): text, or a list of parts whose text is joined into one text when it holds
    no image. Empty text parts are dropped; they render to nothing."""
    if content is None or isinstance(content, str):
        text = content or ""
        return _split_placeholders(text) if placeholders and IMAGE_PLACEHOLDER in text else (text, [])
    if not isinstance(content, list):
        raise UserError(
            f"{where}: field '{key}' must be text or a list of content parts, got {type(content).__name__}"
        )
    parts, sources = [], []
    for j, part in enumerate(content):
        field = f"field '{key}'[{j}]"
        kind = _part_kind(part, field, where)
        if kind == "text":
            parts += [{"type": "text", "text": part["text"]}] if part["text"] else []
        else:
            parts.append({"type": "image"})
            sources.append(_image_source(part, kind, field, where))
    if not sources:
        return "".join(part["text"] for part in parts), []
    return parts, sources


def _part_kind(part, field: str, where: str) -> str:
    if not isinstance(part, dict):
        raise UserError(f"{where}: {field} must be a content part object, got {type(part).__name__}")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise UserError(f"{where}: {field}.text must be text, got {type(part.get('text')).__name__}")
    elif kind not in IMAGE_SOURCES:
        raise UserError(f"{where}: {field} is a {kind!r} part; only text and image parts are read")
    return kind


def _image_source(part: dict, kind: str, field: str, where: str) -> str | None:
    """The part's own image path or URL; None for a bare {"type": "image"}, which the column fills."""
    given = [key for key in IMAGE_SOURCES[kind] if part.get(key) is not None]
    if not given:
        if kind == "image_url":
            raise UserError(f"{where}: {field} is an 'image_url' part without its 'image_url' {{'url': ...}}")
        return None
    if len(given) > 1:
        raise UserError(f"{where}: {field} gives its image twice ({', '.join(given)}); give one")
    source = part[given[0]]
    if kind == "image_url" and isinstance(source, dict):
        source = source.get("url")
    if not isinstance(source, str) or not source:
        raise UserError(
            f"{where}: {field}.{given[0]} must be an image path or URL, got {type(source).__name__}"
        )
    return source


def _split_placeholders(text: str) -> tuple[list[dict], list[None]]:
    """Text with `<image>` placeholders as text and image parts; each image comes from the column."""
    pieces = text.split(IMAGE_PLACEHOLDER)
    parts = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
    for piece in pieces[1:]:
        parts += [{"type": "image"}] + ([{"type": "text", "text": piece}] if piece else [])
    return parts, [None] * (len(pieces) - 1)


def _image_column(record: dict, where: str) -> list[str] | None:
    """The record's image paths (`images`, or LLaVA's `image`; one string or a list); None without one."""
    present = [key for key in IMAGE_COLUMNS if record.get(key) not in (None, "")]
    if not present:
        return None
    if len(present) > 1:
        raise UserError(f"{where}: fields 'images' and 'image' both list images; give one")
    key = present[0]
    images = record[key]
    images = [images] if isinstance(images, str) else images
    if not isinstance(images, list):
        raise UserError(f"{where}: field '{key}' must be a list of image paths, got {type(images).__name__}")
    for j, image in enumerate(images):
        if not isinstance(image, str) or not image:
            raise UserError(f"{where}: field '{key}'[{j}] must be an image path, got {type(image).__name__}")
    return images


def _match_images(sources: list[str | None], column: list[str], where: str) -> list[str]:
    """One reference per image part. A part with its own source keeps it; the others (bare parts and
    placeholders) take the column's images in order. Both count: the row must give exactly one image per
    part, so a column that repeats the parts' own images is refused rather than guessed at."""
    inline = sum(source is not None for source in sources)
    if len(sources) - inline != len(column):
        given = inline + len(column)
        detail = f" ({inline} in the parts, {len(column)} in the image column)" if inline else ""
        raise UserError(f"{where}: {len(sources)} image placeholder(s) but {given} image(s) given{detail}")
    rest = iter(column)
    return [source if source is not None else next(rest) for source in sources]


def _no_images(record: dict, fmt: str, where: str) -> None:
    """Layouts without turns to place images in refuse an image column rather than drop it."""
    for key in IMAGE_COLUMNS:
        if record.get(key) not in (None, "", []):
            raise UserError(
                f"{where}: field '{key}' is read with the messages and conversations layouts, "
                f"not data.format {fmt}"
            )


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


def text_only(example: dict, where: str) -> dict:
    """`example`, refused in one line when it holds images (a text-only model is training on it)."""
    if example.get("images"):
        raise UserError(
            f"{where}: this row has {len(example['images'])} image(s), but model.path is a text-only model; "
            "use a vision-language model or leave the images out"
        )
    return example
