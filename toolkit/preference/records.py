"""Preference records to (prompt, chosen, rejected) conversations.

The published layouts are read, told apart by their keys:
- explicit prompt: `prompt`, `chosen`, `rejected`, each text or a list of {role, content} turns (a text
  prompt is one user turn, a text answer one assistant turn; answers that repeat the prompt's turns, as
  in UltraFeedback-binarized, have them removed);
- implicit prompt: `chosen` and `rejected` only, two whole conversations whose shared opening turns are the
  prompt (HH-RLHF style);
- ranking: `conversations` (sharegpt turns) as the prompt, `chosen` and `rejected` each one {from, value}
  turn, with optional `system` and `tools` columns (LLaMA-Factory);
- unpaired: `prompt`, `completion` and a `label`, one answer flagged desirable or not (TRL's KTO layout),
  read by toolkit/preference/unpaired.py: it is no pair.
Turns may carry tool calls, tool results and reasoning, as in SFT data (see toolkit/data/formats.py).

Any layout may carry a `margin` column: how much better the chosen answer is, a number (a reward model
wants its scores that far apart; rows without one: 0).

Images belong to the prompt, given as SFT data gives them: image parts with their own source, bare image
parts (TRL's image pairs) or `<image>` placeholders, the last two filled in order from the record's
`images` column. Both answers follow the same images, so an image after the prompt is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# formats' turn reader, with its image parts and their matching to the image column, as SFT reads them.
from toolkit.data.formats import FORMAT_KEYS, _image_column, _match_images, _read_turns, tools_of
from toolkit.errors import UserError

LAYOUTS = {
    "ranking": ("conversations", "chosen", "rejected"),
    "explicit": ("prompt", "chosen", "rejected"),
    "implicit": ("chosen", "rejected"),
    "unpaired": ("prompt", "completion"),
}


@dataclass
class Pair:
    prompt: list[dict]
    """The turns both answers follow."""
    chosen: list[dict]
    """Turns of the preferred completion."""
    rejected: list[dict]
    """Turns of the dispreferred completion."""
    tools: list[dict] | None = None
    """JSON schemas of the tools the conversation may call."""
    images: list[str] = field(default_factory=list)
    """The prompt's image references, one per image part in order, as the record gave them."""
    margin: float = 0.0
    """How much better the chosen answer is (the record's `margin`; 0 without one)."""


def detect_layout(record: dict, where: str) -> str:
    for layout, keys in LAYOUTS.items():
        if all(key in record for key in keys):
            return layout
    found = ", ".join(sorted(record)) or "none"
    sft = [fmt for fmt, keys in FORMAT_KEYS.items() if all(key in record for key in keys)]
    if sft:
        raise UserError(
            f"{where}: keys [{found}] are SFT data ({sft[0]} layout), not preference pairs; "
            "train them with recipes/finetune_llm.py"
        )
    raise UserError(
        f"{where}: keys [{found}] are not a preference pair; expected prompt, chosen, rejected "
        "(explicit prompt) or chosen, rejected (conversations sharing their opening turns)"
    )


def to_pair(record: dict, layout: str, where: str) -> Pair:
    """The record's pair; a missing side, identical answers or no shared prompt is an error at `where`."""
    if layout == "unpaired":
        raise UserError(
            f"{where}: keys prompt and completion are one answer, not a pair: SFT data "
            "(recipes/finetune_llm.py)"
            " or, flagged by a 'label', KTO's (dpo.loss: kto)"
        )
    for key in LAYOUTS[layout]:
        if record.get(key) in (None, "", []):
            raise UserError(f"{where}: missing or empty '{key}'")
    column = _image_column(record, where)
    if layout == "ranking":
        return _ranking(record, column, where)
    placeholders = column is not None
    chosen, sources = _turns(record["chosen"], "chosen", "assistant", placeholders, where)
    rejected = _turns(record["rejected"], "rejected", "assistant", placeholders, where)[0]
    if layout == "explicit":
        prompt, sources = _turns(record["prompt"], "prompt", "user", placeholders, where)
        chosen, rejected = _after(prompt, chosen), _after(prompt, rejected)
    else:
        shared = _shared_prefix(chosen, rejected)
        if shared == 0:
            raise UserError(f"{where}: 'chosen' and 'rejected' share no opening turn to use as the prompt")
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        sources = sources[: _image_parts(prompt)]
    if not chosen or not rejected:
        side = "chosen" if not chosen else "rejected"
        raise UserError(f"{where}: '{side}' has no turn after the prompt")
    images = _prompt_images(chosen, rejected, sources, column, where)
    return _checked(
        Pair(prompt, chosen, rejected, tools_of(record, where), images, _margin(record, where)), where
    )


def _checked(pair: Pair, where: str) -> Pair:
    if pair.chosen == pair.rejected:
        raise UserError(f"{where}: 'chosen' is identical to 'rejected'")
    return pair


def _margin(record: dict, where: str) -> float:
    value = record.get("margin", 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise UserError(f"{where}: 'margin' must be a number, got {value!r}")
    return float(value)


def _ranking(record: dict, column: list[str] | None, where: str) -> Pair:
    system = record.get("system")
    prompt = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
    if not isinstance(record["conversations"], list):
        raise UserError(f"{where}: 'conversations' must be a list of turns")
    turns, sources = _read_turns(
        record["conversations"], "sharegpt", "conversations", where, column is not None
    )
    answers = []
    for key in ("chosen", "rejected"):
        value = record[key]
        if not isinstance(value, dict):
            raise UserError(f"{where}: '{key}' must be one {{from, value}} turn, got {type(value).__name__}")
        answers.append(_read_turns([value], "sharegpt", key, where, column is not None)[0])
    images = _prompt_images(answers[0], answers[1], sources, column, where)
    pair = Pair(
        prompt + turns, answers[0], answers[1], tools_of(record, where), images, _margin(record, where)
    )
    return _checked(pair, where)


def _turns(value, key: str, role: str, placeholders: bool, where: str) -> tuple[list[dict], list[str | None]]:
    """(messages, one source per image part) of a text or a list of turns; `placeholders`: `<image>` in
    the text is an image (the record has an image column)."""
    if isinstance(value, str):
        value = [{"role": role, "content": value}]
    if not isinstance(value, list):
        raise UserError(f"{where}: '{key}' must be text or a list of turns, got {type(value).__name__}")
    return _read_turns(value, "messages", key, where, placeholders)


def _prompt_images(
    chosen: list[dict], rejected: list[dict], sources: list[str | None], column: list[str] | None, where: str
) -> list[str]:
    """The prompt's image references; answers that hold an image of their own are refused."""
    for key, answer in (("chosen", chosen), ("rejected", rejected)):
        if _image_parts(answer):
            raise UserError(f"{where}: '{key}' holds an image after the prompt; put the images in the prompt")
    return _match_images(sources, column or [], where)


def _image_parts(messages: list[dict]) -> int:
    return sum(
        part.get("type") == "image"
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
    )


def _after(prompt: list[dict], answer: list[dict]) -> list[dict]:
    return answer[len(prompt) :] if answer[: len(prompt)] == prompt else answer


def _shared_prefix(a: list[dict], b: list[dict]) -> int:
    """Opening turns both conversations share, stopping before the last turn of either."""
    count = 0
    while count < min(len(a), len(b)) - 1 and a[count] == b[count]:
        count += 1
    return count
