"""Data positions as JSON: how a checkpoint stores what an iterator's `get_state()` returned.

JSON values pass through; what JSON would lose or change is tagged: bytes (base64), NumPy scalars
and arrays (dtype, shape and a list of values), tuples, and dicts whose keys are not all strings.
Nothing is ever read back as code, so a checkpoint directory from someone else cannot run anything
on resume. A position holding anything else cannot be stored and is refused when it is first read.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np

TAG = "__dew__"  # the key that marks a tagged value; a dict that has it is itself stored tagged


class PositionNotStorable(TypeError):
    """An iterator's position holds a value that JSON with Dew's tags cannot represent."""


def encode(position: Any, *, source: str = "the data iterator") -> Any:
    """`position` as JSON-ready values; raises PositionNotStorable naming `source` and the path."""
    return _encode(position, source, "position")


def decode(encoded: Any) -> Any:
    """The position `encode` was given, rebuilt from its JSON form."""
    if isinstance(encoded, list):
        return [decode(item) for item in encoded]
    if not isinstance(encoded, dict):
        return encoded
    if TAG not in encoded:
        return {key: decode(value) for key, value in encoded.items()}
    kind = encoded[TAG]
    if kind == "bytes":
        return base64.b64decode(encoded["base64"], validate=True)
    if kind == "ndarray":
        values = [decode(item) for item in encoded["values"]]
        return np.asarray(values, dtype=_numeric(encoded["dtype"])).reshape(encoded["shape"])
    if kind == "scalar":
        return _numeric(encoded["dtype"]).type(decode(encoded["value"]))
    if kind == "tuple":
        return tuple(decode(item) for item in encoded["items"])
    if kind == "dict":
        return {decode(key): decode(value) for key, value in encoded["items"]}
    if kind == "float":
        return float(encoded["value"])
    raise ValueError(f"Unknown tag {kind!r} in a stored data position; it was written by another tool.")


def _numeric(name: str) -> np.dtype:
    """A stored dtype, which must be numeric or bool as `encode` writes them."""
    dtype = np.dtype(name)
    if dtype.kind not in "biuf":
        raise ValueError(f"A stored data position names dtype {name!r}; positions hold numbers and bools only.")
    return dtype


def _encode(value: Any, source: str, path: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if type(value) is int:
        return value
    if type(value) is float:
        # JSON has no NaN or infinity; store them by name so the file stays standard JSON.
        return value if math.isfinite(value) else {TAG: "float", "value": repr(value)}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {TAG: "bytes", "base64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return {TAG: "scalar", "dtype": value.dtype.str, "value": _plain(value.item())}
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        values = [_plain(item) for item in value.reshape(-1).tolist()]
        return {TAG: "ndarray", "dtype": value.dtype.str, "shape": list(value.shape), "values": values}
    if isinstance(value, list):
        return [_encode(item, source, f"{path}[{i}]") for i, item in enumerate(value)]
    if type(value) is tuple:
        return {TAG: "tuple", "items": [_encode(item, source, f"{path}[{i}]") for i, item in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value) and TAG not in value:
            return {key: _encode(item, source, f"{path}[{key!r}]") for key, item in value.items()}
        return {
            TAG: "dict",
            "items": [
                [_encode(key, source, f"{path} key {key!r}"), _encode(item, source, f"{path}[{key!r}]")]
                for key, item in value.items()
            ],
        }
    raise PositionNotStorable(
        f"The data position of {source} (what its get_state() returned) holds a "
        f"{type(value).__module__}.{type(value).__qualname__} at {path}, which a checkpoint cannot "
        "store: positions are kept as JSON (dicts, lists, tuples, strings, numbers, bytes, NumPy "
        "numeric scalars and arrays) so that resuming never runs code from the checkpoint. Make "
        "get_state() return those types, or train without checkpoint_every."
    )


def _plain(item: Any) -> Any:
    """A float that JSON cannot hold (NaN, infinity) as its tagged name; other values as they are."""
    if isinstance(item, float) and not math.isfinite(item):
        return {TAG: "float", "value": repr(item)}
    return item
