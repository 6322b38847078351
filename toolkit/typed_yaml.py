"""YAML into typed dataclasses and back, for any config schema: types checked and widened (numbers only),
unknown keys refused with the closest known one, dotted overrides, per-field docs read from the source.
The value bounds a field declares are checked by toolkit/fields.py."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Literal

import yaml

from toolkit.errors import UserError
from toolkit.fields import describe


def read_yaml_mapping(path: Path, what: str) -> dict:
    """The mapping a YAML file holds (an empty file: {}); a missing, unparsable or non-mapping file is a
    UserError naming it as `what`."""
    if not path.is_file():
        raise UserError(f"{path}: {what} not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}: not valid YAML ({getattr(exc, 'problem', exc)}{where})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: the top level must be a mapping of keys")
    return raw


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def dotted(tree: dict, prefix: str = "") -> dict:
    """A nested mapping as one level of dotted keys (`train.max_steps`), leaves unchanged."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(dotted(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def flat_dict(cfg) -> dict:
    """Dotted keys to scalars (lists as strings): the shape experiment trackers accept."""
    return {
        key: str(value) if isinstance(value, list) or value is None else value
        for key, value in dotted(to_dict(cfg)).items()
    }


def save_config(cfg, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def field_docs(cls, prefix: str = "") -> dict[str, str]:
    """Map each dotted key to its one-line docstring (read from the source) and the values it allows."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    hints = typing.get_type_hints(cls, include_extras=True)
    body = ast.parse(inspect.getsource(cls)).body[0].body
    for stmt, nxt in zip(body, body[1:] + [None]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            allowed = describe(hints[stmt.target.id])
            docs[prefix + stmt.target.id] = nxt.value.value + (f" Allowed: {allowed}." if allowed else "")
    for f in dataclasses.fields(cls):
        sub = _dataclass_type(cls, f)
        if sub:
            docs.update(field_docs(sub, f"{prefix}{f.name}."))
    return docs


def _dataclass_type(cls, f):
    hint = typing.get_type_hints(cls)[f.name]
    return hint if dataclasses.is_dataclass(hint) else None


@dataclasses.dataclass(frozen=True)
class Sources:
    """Where a config's values came from, for naming it in an error: its file, but for the dotted keys the
    command line set (and every key below them)."""

    file: str
    overridden: frozenset[str] = frozenset()

    @classmethod
    def given(cls, file: str, overrides) -> Sources:
        """`file`, but for the keys the `key=value` items of `overrides` set."""
        return cls(str(file), frozenset(item.partition("=")[0].strip() for item in overrides))

    def __format__(self, key: str) -> str:
        """In a message: f"{sources}" is the file; f"{sources:train.max_steps}" where that key was set, "in
        FILE" or "on the command line"."""
        if not key:
            return self.file
        return "on the command line" if self.of(key) == "command line" else f"in {self.file}"

    def of(self, key: str) -> str:
        """The source of `key` (dotted, list items as `[i]`)."""
        parts = key.split("[")[0].split(".")
        set_here = any(".".join(parts[:n]) in self.overridden for n in range(1, len(parts) + 1))
        return "command line" if set_here else self.file


def build(cls, raw: dict, prefix: str, sources: Sources):
    """An instance of dataclass `cls` from `raw`; a wrong type or an unknown key raises naming it and where
    it was set."""
    if not isinstance(raw, dict):
        section = prefix.rstrip(".")
        raise UserError(f"{sources.of(section)}: {section} must be a mapping, got {type(raw).__name__}")
    names = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in names:
            where = sources.of(prefix + key)
            raise UserError(f"{where}: unknown key {prefix}{key}{_suggest(key, names, prefix)}")
    values = {}
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = build(hint, value if value is not None else {}, f"{prefix}{name}.", sources)
        else:
            values[name] = _coerce(value, hint, f"{prefix}{name}", sources)
    return cls(**values)


BOOL_WORDS = {False: ("no", "off", "false"), True: ("yes", "on", "true")}


def _coerce(value, hint, key: str, sources: Sources):
    """Return `value` as type `hint`, or raise naming the key; only numbers widen to floats."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _coerce(value, option, key, sources)
            except UserError:
                continue
        raise _wrong_type(value, hint, key, sources)
    if hint is type(None):
        if value is None:
            return None
    elif origin is Literal:
        words = typing.get_args(hint)
        if isinstance(value, bool):  # YAML 1.1 reads no/off and yes/on as booleans: the word meant
            spelled = [w for w in (BOOL_WORDS[value]) if w in words]
            if spelled:
                return spelled[0]
        # The type of its words; which words are allowed is checked with every other declared bound.
        return _coerce(value, type(words[0]), key, sources)
    elif origin is list:
        if isinstance(value, list):
            (item,) = typing.get_args(hint)
            return [_coerce(v, item, f"{key}[{i}]", sources) for i, v in enumerate(value)]
    elif hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif hint is float and isinstance(value, str) and _is_number(value):
        return float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
    elif hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    elif isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    raise _wrong_type(value, hint, key, sources)


def _wrong_type(value, hint, key: str, sources: Sources) -> UserError:
    return UserError(f"{sources.of(key)}: {key} has the wrong type: {value!r} is not {_type_name(hint)}")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _type_name(hint) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", str(hint))


def _suggest(key: str, names, prefix: str) -> str:
    close = difflib.get_close_matches(key, list(names), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def set_dotted(raw: dict, key: str, value, source: str) -> None:
    """Set `key` (dotted: train.max_steps) in the nested mapping `raw`, creating sections."""
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"{source}: {key}: {part} is not a section")
    node[parts[-1]] = value
