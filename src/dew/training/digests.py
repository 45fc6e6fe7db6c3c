"""Digests: a SHA-256 of every array a checkpoint step holds and of its data position.

The one home for how Dew hashes what it saves: `Checkpoints` records a step's digests with these
functions when it writes (see `dew.training.digest_item`) and compares them when it reads.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

FORMAT = 1


def array_digest(array: Any) -> str:
    """`sha256:<hex>` of an array's dtype, shape and C-order bytes.

    The dtype and shape are part of what is hashed, so the same bytes read as another type or shape
    do not match.
    """
    array = np.ascontiguousarray(array)
    digest = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
    digest.update(array.reshape(-1).view(np.uint8))
    return f"sha256:{digest.hexdigest()}"


def json_digest(value: Any) -> str:
    """`sha256:<hex>` of a JSON value in canonical form (sorted keys, no spaces)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return f"sha256:{hashlib.sha256(text.encode()).hexdigest()}"


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
