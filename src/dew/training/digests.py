"""Digests: a CRC-32 checksum of every array a checkpoint step holds and of its data position.

The one home for how Dew checksums what it saves: `Checkpoints` records a step's digests with these
functions when it writes (see `dew.training.digest_item`) and compares them when it reads. CRC-32
finds every single flipped bit and every damaged run of up to 32 bits, and misses other accidental
damage with odds of 1 in 2**32, at 2-3x the speed of SHA-256 (zlib releases the GIL while it
runs). It guards against accidents (bad disks, truncated copies, full disks), not against someone
who rewrites the digests too.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

FORMAT = 1


def array_digest(array: Any) -> str:
    """`crc32:<8 hex digits>` of an array's dtype, shape and C-order bytes.

    The dtype and shape are part of what is checksummed, so the same bytes read as another type or
    shape do not match.
    """
    array = np.ascontiguousarray(array)
    checksum = zlib.crc32(f"{array.dtype.str}{array.shape}".encode())
    checksum = zlib.crc32(array.reshape(-1).view(np.uint8), checksum)
    return f"crc32:{checksum:08x}"


def json_digest(value: Any) -> str:
    """`crc32:<8 hex digits>` of a JSON value in canonical form (sorted keys, no spaces)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return f"crc32:{zlib.crc32(text.encode()):08x}"


def named_arrays(tree: Any) -> list[tuple[str, Any]]:
    """The array leaves of `tree` with `/`-joined names (`variables/params/Dense_0/kernel`).

    Dict keys, sequence indices and named-tuple fields all name a level by themselves, so a tree
    read back by Orbax (where named tuples may come back as dicts) gets the same names.
    """
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [("/".join(_key_name(key) for key in path), leaf) for path, leaf in leaves]


def _key_name(key: Any) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def record(arrays: Sequence[tuple[str, Any]] | None, data: Any) -> dict[str, Any]:
    """The digest record of one step; `arrays` None records that the arrays were not digested."""
    return {
        "format": FORMAT,
        "arrays": None if arrays is None else {name: array_digest(value) for name, value in arrays},
        "data": json_digest(data),
    }


def check_record(value: Any) -> dict[str, Any]:
    """`value` if it has the form `record` writes; raises ValueError saying what is wrong."""
    if not isinstance(value, Mapping) or value.get("format") != FORMAT:
        raise ValueError(f"not a format-{FORMAT} digest record")
    arrays = value.get("arrays")
    if arrays is not None and not (
        isinstance(arrays, Mapping) and all(isinstance(v, str) for v in arrays.values())
    ):
        raise ValueError("its 'arrays' entry is not a mapping of names to digests")
    if not isinstance(value.get("data"), str):
        raise ValueError("it has no 'data' digest")
    return dict(value)
