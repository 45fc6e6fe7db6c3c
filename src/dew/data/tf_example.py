"""tf.train.Example, read and written without TensorFlow: a small protobuf wire-format codec.

TFDS stores each record of a prepared dataset as a serialized Example. Only the message's three
list kinds are needed:

    Example   { Features features = 1; }
    Features  { map<string, Feature> feature = 1; }
    Feature   { oneof { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }
    BytesList { repeated bytes value = 1; }
    FloatList { repeated float value = 1 [packed]; }
    Int64List { repeated int64 value = 1 [packed]; }

A repeated number may arrive packed or one field at a time; both decode.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _fields(data: memoryview) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of each field of one serialized message."""
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos : pos + length], pos + length
        elif wire == 5:
            value, pos = data[pos : pos + 4], pos + 4
        elif wire == 1:
            value, pos = data[pos : pos + 8], pos + 8
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} in field {number}")
        if pos > end:
            raise ValueError("truncated protobuf message")
        yield number, wire, value


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _feature(data: memoryview) -> list[bytes] | np.ndarray:
    for kind, _, payload in _fields(data):
        if kind == 1:  # BytesList
            return [bytes(value) for number, _, value in _fields(payload) if number == 1]
        if kind == 2:  # FloatList
            floats: list[np.ndarray] = []
            for number, wire, value in _fields(payload):
                if number == 1:
                    floats.append(np.frombuffer(bytes(value), dtype="<f4"))
            return np.concatenate(floats) if floats else np.zeros(0, np.float32)
        if kind == 3:  # Int64List
            ints: list[int] = []
            for number, wire, value in _fields(payload):
                if number != 1:
                    continue
                if wire == 0:
                    ints.append(_signed(value))
                else:
                    pos = 0
                    while pos < len(value):
                        item, pos = _varint(value, pos)
                        ints.append(_signed(item))
            return np.asarray(ints, dtype=np.int64)
    return []  # a Feature with no list set


def decode_example(data: bytes) -> dict[str, list[bytes] | np.ndarray]:
    """A serialized tf.train.Example as {name: list of bytes | int64 array | float32 array}."""
    out: dict[str, Any] = {}
    for number, _, features in _fields(memoryview(data)):
        if number != 1:
            continue
        for entry_number, _, entry in _fields(features):
            if entry_number != 1:
                continue
            name, value = "", memoryview(b"")
            for part, _, payload in _fields(entry):
                if part == 1:
                    name = bytes(payload).decode("utf-8")
                elif part == 2:
                    value = payload
            out[name] = _feature(value)
    return out


def _encode_varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | 2) + _encode_varint(len(payload)) + payload


def encode_example(features: Mapping[str, Any]) -> bytes:
    """Serialize {name: bytes | str | int | float | a sequence of one kind} as a tf.train.Example.

    Integers become an int64_list, floats a float_list, bytes and text a bytes_list.
    """
    entries = b""
    for name in sorted(features):
        value = features[name]
        if isinstance(value, (bytes, str)) or np.ndim(value) == 0:
            value = [value]
        items = list(value.tolist() if isinstance(value, np.ndarray) else value)
        if all(isinstance(item, (bytes, str)) for item in items):
            data = b"".join(
                _length_delimited(1, item.encode("utf-8") if isinstance(item, str) else item)
                for item in items
            )
            feature = _length_delimited(1, data)
        elif all(isinstance(item, (int, np.integer)) and not isinstance(item, bool) for item in items):
            packed = b"".join(_encode_varint(int(item)) for item in items)
            feature = _length_delimited(3, _length_delimited(1, packed))
        elif all(isinstance(item, (int, float, np.number)) for item in items):
            feature = _length_delimited(2, _length_delimited(1, np.asarray(items, "<f4").tobytes()))
        else:
            raise TypeError(
                f"Feature {name!r} must hold bytes/str, ints or floats of one kind; got {value!r}."
            )
        entry = _length_delimited(1, name.encode("utf-8")) + _length_delimited(2, feature)
        entries += _length_delimited(1, entry)
    return _length_delimited(1, entries)
