"""Changing one setting of a RunConfig by its dotted path, such as `optim.learning_rate`.

A path walks dataclass fields and mapping keys (`model.settings.emb_features` reaches into the
recorded model settings). A path that names nothing, or a value of the wrong type, fails with the
near names and the expected type, before anything trains.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import types
import typing
from collections.abc import Mapping
from typing import Any


def names_at(node: Any) -> list[str]:
    """The names a path can take one level below `node`."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return [field.name for field in dataclasses.fields(node) if field.init]
    if isinstance(node, Mapping):
        return [str(key) for key in node]
    return []


def lookup(config: Any, path: str) -> tuple[Any, Any]:
    """The (type hint, current value) at `path`; the hint is None where only the value says the type."""
    if not isinstance(path, str) or not path or any(not part for part in path.split(".")):
        raise ValueError(f"A setting path is dotted field names like 'optim.learning_rate'; got {path!r}.")
    node, hint = config, None
    walked: list[str] = []
    for part in path.split("."):
        names = names_at(node)
        if part not in names:
            near = difflib.get_close_matches(part, names, n=3, cutoff=0.5)
            where = ".".join(walked) or type(config).__name__
            if not names:
                raise ValueError(
                    f"{path!r} goes below {where}, which is a {type(node).__name__} with no fields to set."
                )
            suggestion = f" Did you mean {', '.join(repr('.'.join([*walked, n])) for n in near)}?" if near else ""
            raise ValueError(
                f"{path!r} names no setting: {where} has no {part!r}.{suggestion} Its settings are {names}."
            )
        if isinstance(node, Mapping):
            hint = None
            node = node[part]
        else:
            hint = _hints(type(node)).get(part)
            node = getattr(node, part)
        walked.append(part)
    return hint, node


def check_value(config: Any, path: str, value: Any) -> None:
    """Raise a TypeError when `value` is not of the type the setting at `path` holds."""
    hint, current = lookup(config, path)
    if hint is not None and hint is not Any:
        if _matches(hint, value):
            return
        expected = _describe(hint)
    elif current is None or _matches(type(current), value):
        return
    else:
        expected = type(current).__name__
    raise TypeError(f"{path} holds {expected}; got {value!r} ({type(value).__name__}).")


def override(config: Any, path: str, value: Any) -> Any:
    """A copy of `config` with the setting at `path` replaced by `value` (checked first)."""
    check_value(config, path, value)
    return _replace(config, path.split("."), value)


def apply_overrides(config: Any, values: Mapping[str, Any]) -> Any:
    """`config` with every `path: value` of `values` applied."""
    for path, value in values.items():
        config = override(config, path, value)
    return config


def _replace(node: Any, parts: list[str], value: Any) -> Any:
    if not parts:
        return value
    head, rest = parts[0], parts[1:]
    if isinstance(node, Mapping):
        return {**node, head: _replace(node[head], rest, value)}
    return dataclasses.replace(node, **{head: _replace(getattr(node, head), rest, value)})


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # a hint that cannot be evaluated: fall back to the value's own type
        return {}


def _matches(hint: Any, value: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if hint is type(None) or hint is None:
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_matches(member, value) for member in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(args[0], item) for item in value)
        return not args or (len(args) == len(value) and all(_matches(a, v) for a, v in zip(args, value)))
    if origin is not None:
        return isinstance(value, origin)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    return isinstance(hint, type) and isinstance(value, hint)


def _describe(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")
