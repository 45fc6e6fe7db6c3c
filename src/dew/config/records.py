"""Turning settings into JSON and back: dataclasses by import path, dtypes by name.

A record is plain JSON. A dataclass (a Flax module's settings, `TokenWindows`, `Sampling`,
`LayerKind`) becomes `{"__type__": "module.Class", "fields": {...}}`; a class with a
``__record__()`` method returning ``(args, fields)`` adds ``"args": [...]`` and is rebuilt as
``Class(*args, **fields)``; a dtype becomes
`{"__dtype__": "bfloat16"}`; tuples keep their type as `{"__tuple__": [...]}`. Only types that
`import_path` can reach are rebuilt, and reading a record imports their modules.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from collections.abc import Mapping
from typing import Any

import numpy as np

# Fields of a Flax module that are wiring, not settings.
_MODULE_INTERNALS = {"parent", "name"}


def import_path(obj: Any) -> str:
    """`module.QualName` of a class or function."""
    target = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    if "<locals>" in target.__qualname__:
        raise ValueError(
            f"{target.__qualname__} is defined inside a function, so a record cannot name it by "
            "import path. Define it at module level."
        )
    return f"{target.__module__}.{target.__qualname__}"


def resolve(path: str) -> Any:
    """The object named `module.QualName`, importing the longest module prefix that exists."""
    if not isinstance(path, str) or "." not in path:
        raise ValueError(f"Expected an import path like 'package.module.Name'; got {path!r}.")
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        try:
            for attribute in parts[cut:]:
                value = getattr(value, attribute)
        except AttributeError:
            break
        return value
    raise ImportError(f"Cannot import {path!r}: no module on the path defines it.")


def to_record(value: Any) -> Any:
    """A JSON-ready form of `value`."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return {"__enum__": import_path(type(value)), "value": value.value}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if isinstance(value, np.generic):
        return value.item()
    dtype = _as_dtype(value)
    if dtype is not None:
        return {"__dtype__": dtype.name}
    if isinstance(value, tuple):
        return {"__tuple__": [to_record(v) for v in value]}
    if isinstance(value, list):
        return [to_record(v) for v in value]
    if isinstance(value, Mapping):
        keys = list(value)
        if not all(isinstance(k, str) for k in keys):
            raise TypeError(f"Record mappings need string keys; got {keys!r}.")
        return {k: to_record(v) for k, v in value.items()}
    if callable(getattr(type(value), "__record__", None)):  # a class that says how it is rebuilt
        args, fields = value.__record__()
        return {"__type__": import_path(value), "args": [to_record(v) for v in args],
                "fields": {k: to_record(v) for k, v in fields.items()}}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            f.name: to_record(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.init and f.name not in _MODULE_INTERNALS
        }
        return {"__type__": import_path(value), "fields": fields}
    raise TypeError(
        f"Cannot record a {type(value).__name__} ({value!r}); records hold numbers, strings, "
        "dtypes, lists, dicts and dataclasses."
    )


def from_record(record: Any) -> Any:
    """Rebuild what `to_record` wrote."""
    if isinstance(record, list):
        return [from_record(v) for v in record]
    if not isinstance(record, dict):
        return record
    if "__dtype__" in record:
        import jax.numpy as jnp

        return jnp.dtype(record["__dtype__"])
    if "__tuple__" in record:
        return tuple(from_record(v) for v in record["__tuple__"])
    if "__enum__" in record:
        return resolve(record["__enum__"])(record["value"])
    if "__type__" in record:
        cls = resolve(record["__type__"])
        args = [from_record(v) for v in record.get("args", [])]
        return cls(*args, **{k: from_record(v) for k, v in record["fields"].items()})
    return {k: from_record(v) for k, v in record.items()}


def _as_dtype(value: Any):
    """The dtype `value` names (np.dtype, a NumPy scalar type, jnp.float32, ...), or None."""
    if isinstance(value, np.dtype):
        return value
    if isinstance(value, type) and (issubclass(value, np.generic) or hasattr(value, "dtype")):
        try:
            return np.dtype(value)
        except TypeError:
            return None
    return None
