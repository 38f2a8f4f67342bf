"""Typed settings from plain data (a YAML section, a request's fields): a dataclass built from a dict, every
problem said once, on a line of its own: an unknown key with the nearest known one, a value of the wrong type
(only the simple types settings use are checked), and what the dataclass itself refuses."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """Settings that cannot run; `problems` holds one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def nearest(key: str, known: typing.Iterable[str]) -> str:
    """' (did you mean X?)' for the closest known key, or ''."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def checked_section(cls, data: dict | None, name: str | None = None):
    data = dict(data or {})
    name = name or cls.__name__
    names = [f.name for f in dataclasses.fields(cls)]
    problems = [f"unknown key {name}.{k}{nearest(k, names)}" for k in data if k not in names]
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        if key in names and not fits(value, hints[key]):
            problems.append(f"{name}.{key} must be {type_name(hints[key])}, got {value!r}")
    if problems:
        raise ConfigError(problems)
    try:
        return cls(**data)
    except (ValueError, TypeError) as e:
        raise ConfigError([f"{name}: {e}"]) from None


def fits(value: Any, hint: Any) -> bool:
    """Whether a YAML value fits a field's annotation (only the simple types settings use are checked)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (dict, list, tuple):
        return isinstance(value, origin)
    return True  # Any and the like


def type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(type_name(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "null"
    origin = typing.get_origin(hint)
    return getattr(origin or hint, "__name__", str(hint))
