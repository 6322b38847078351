"""Allowed values declared on typed dataclass fields, and the one check derived from them.

A field says what it accepts in its annotation: `Literal["a", "b"]` for a fixed set of words,
`Annotated[int, Range(low=0)]` for a numeric interval, `Annotated[list[...], Length(2)]` for a list of
fixed length. `field_errors` checks an instance against its annotations; `choices` and `describe`
give the same facts to command-line parsers and documentation.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """A numeric interval; a bound left as None is open-ended."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    """True excludes `low` itself (0 < x rather than 0 <= x)."""
    high_open: bool = False
    """True excludes `high` itself."""

    def __contains__(self, value) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        if self.high is None:
            if self.low == 0:
                return "positive" if self.low_open else ">= 0"
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{_number(self.low)}, {_number(self.high)}{right}"


@dataclass(frozen=True)
class Length:
    """A list of exactly `count` items."""

    count: int


PositiveInt = typing.Annotated[int, Range(low=0, low_open=True)]
NonNegativeInt = typing.Annotated[int, Range(low=0)]
PositiveFloat = typing.Annotated[float, Range(low=0, low_open=True)]
NonNegativeFloat = typing.Annotated[float, Range(low=0)]
Fraction = typing.Annotated[float, Range(low=0, high=1)]
"""A share from 0 to 1, both included."""
Probability = typing.Annotated[float, Range(low=0, high=1, high_open=True)]
"""From 0 up to, not including, 1 (a dropout rate, an Adam beta)."""


def field_errors(obj, prefix: str = "") -> list[str]:
    """One message per field of dataclass `obj` (nested ones included) whose value its annotation refuses."""
    return [f"{key}: {message}" for key, message in field_problems(obj, prefix)]


def field_problems(obj, prefix: str = "") -> list[tuple[str, str]]:
    """`field_errors` as (dotted key, why) pairs."""
    problems = []
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            problems += field_problems(value, key + ".")
        else:
            message = value_error(value, hints[f.name])
            if message:
                problems.append((key, message))
    return problems


def value_error(value, hint) -> str:
    """Why `value` is not allowed by `hint` ("" when it is); only declared sets and bounds are checked."""
    if typing.get_origin(hint) is typing.Annotated:
        base, *rules = typing.get_args(hint)
        for rule in rules:
            if isinstance(rule, Range) and _is_number(value) and value not in rule:
                return f"must be {rule}, got {value}"
            if isinstance(rule, Length) and isinstance(value, list) and len(value) != rule.count:
                return f"must be a list of {rule.count} values, got {value}"
        return value_error(value, base)
    allowed = choices(hint)
    if allowed and not any(value == a and type(value) is type(a) for a in allowed):
        return f"{value!r} is not one of {', '.join(_word(a) for a in allowed)}"
    if typing.get_origin(hint) is list and isinstance(value, list):
        (item,) = typing.get_args(hint)
        for i, v in enumerate(value):
            message = value_error(v, item)
            if message:
                return f"item {i}: {message}"
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            if _matches(value, option):
                return value_error(value, option)
    return ""


def choices(hint) -> tuple:
    """The fixed set of values `hint` allows (a Literal, or bool | Literal); () when it is open."""
    if typing.get_origin(hint) is typing.Annotated:
        return choices(typing.get_args(hint)[0])
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        parts = [(True, False) if o is bool else choices(o) for o in options]
        return tuple(v for part in parts for v in part) if all(parts) else ()
    return ()


def describe(hint) -> str:
    """What a field accepts, in words, for documentation ("" when any value of its type will do)."""
    allowed = choices(hint)
    if allowed:
        return "one of " + ", ".join(_word(a) for a in allowed)
    if typing.get_origin(hint) is typing.Annotated:
        base, *rules = typing.get_args(hint)
        words = [str(r) if isinstance(r, Range) else f"{r.count} values" for r in rules]
        return ", ".join(w for w in [*words, describe(base)] if w)
    if typing.get_origin(hint) is list:
        inner = describe(typing.get_args(hint)[0])
        return f"each {inner}" if inner else ""
    return ""


def _matches(value, option) -> bool:
    base = typing.get_args(option)[0] if typing.get_origin(option) is typing.Annotated else option
    origin = typing.get_origin(base)
    if origin is typing.Literal:
        return value in typing.get_args(base)
    if base is type(None):
        return value is None
    return isinstance(value, origin or base)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _word(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
