"""Move weights between a Flax params tree and a torch checkpoint whose names follow a rename rule.

The VAE and text-encoder loaders name each parameter by a function of its path (``hf_name``), so
one pair of functions serves them all. Layouts differ only for kernels: a Dense kernel is
``[in, out]`` in Flax and ``[out, in]`` in torch, a conv kernel ``[kh, kw, in, out]`` against
``[out, in, kh, kw]``. Every tensor must land on a parameter of the expected shape and every
parameter must be filled, so a checkpoint that does not match its config fails by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from flax.core import meta

Path = tuple[str, ...]


def expected_params(model: Any, *example: Any, **kwargs: Any) -> dict[Path, jax.ShapeDtypeStruct]:
    """Every param path of ``model`` (as a tuple of names) with its shape, computed without allocating."""
    abstract = jax.eval_shape(model.init, jax.random.key(0), *example, **kwargs)
    return traverse_util.flatten_dict(meta.unbox(abstract)["params"])


def _to_torch(path: Path, array: np.ndarray) -> np.ndarray:
    if path[-1] == "kernel" and array.ndim == 2:
        return array.T
    if path[-1] == "kernel" and array.ndim == 4:
        return array.transpose(3, 2, 0, 1)
    return array


def _to_flax(path: Path, array: np.ndarray) -> np.ndarray:
    if path[-1] == "kernel" and array.ndim == 2:
        return array.T
    if path[-1] == "kernel" and array.ndim == 4:
        return array.transpose(2, 3, 1, 0)
    return array


def _torch_shape(path: Path, shape: tuple[int, ...]) -> list[int]:
    """The shape a param of ``shape`` has in the torch checkpoint."""
    if path[-1] == "kernel" and len(shape) == 2:
        return [shape[1], shape[0]]
    if path[-1] == "kernel" and len(shape) == 4:
        return [shape[3], shape[2], shape[0], shape[1]]
    return list(shape)


def _some(names: list[str], limit: int = 6) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return f"{names[:limit]}{more}"


def read_params(checkpoint: Mapping[str, np.ndarray], expected: Mapping[Path, Any],
                hf_name: Callable[[Path], str], *, where: str, param_dtype: Any = jnp.float32,
                ignored: Callable[[str], bool] = lambda name: False) -> dict[str, Any]:
    """The params tree filled from ``checkpoint``; ``ignored`` names tensors that may be left over."""
    names = {path: hf_name(path) for path in expected}
    missing = sorted(name for name in names.values() if name not in checkpoint)
    wanted = set(names.values())
    unexpected = sorted(name for name in checkpoint if name not in wanted and not ignored(name))
    if missing or unexpected:
        parts = [f"{label} tensors {_some(found)}"
                 for label, found in (("missing", missing), ("unexpected", unexpected)) if found]
        raise ValueError(
            f"the weights in {where} do not match its config.json: {'; '.join(parts)}. Check the "
            "weights belong to this config and the directory holds the model Dew was asked to load"
        )
    flat = {}
    for path, spec in expected.items():
        array = np.asarray(checkpoint[names[path]])
        if list(array.shape) != _torch_shape(path, tuple(spec.shape)):
            raise ValueError(
                f"tensor {names[path]!r} in {where} has shape {list(array.shape)}, but config.json "
                f"implies {_torch_shape(path, tuple(spec.shape))}; the weights and the config disagree"
            )
        array = _to_flax(path, array)
        flat[path] = jnp.asarray(np.asarray(array, dtype=jnp.dtype(param_dtype)))
    return traverse_util.unflatten_dict(flat)


def torch_tensors(params: Mapping[str, Any], expected: Mapping[Path, Any],
                  hf_name: Callable[[Path], str], *, dtype: Any = None) -> dict[str, np.ndarray]:
    """Checkpoint name -> host array in torch's layout, after checking ``params`` fit the model."""
    flat = traverse_util.flatten_dict(dict(meta.unbox(params)))
    missing = sorted("/".join(p) for p in set(expected) - set(flat))
    unexpected = sorted("/".join(p) for p in set(flat) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"the variables do not fit the model: missing params {missing[:6]}, unexpected params "
            f"{unexpected[:6]}. Pass the variables made with this model"
        )
    tensors = {}
    for path, spec in expected.items():
        array = np.asarray(jax.device_get(flat[path]))
        if array.shape != tuple(spec.shape):
            raise ValueError(
                f"param {'/'.join(path)!r} has shape {list(array.shape)}, but the model expects "
                f"{list(spec.shape)}; the variables were made for another configuration"
            )
        if dtype is not None and jnp.issubdtype(array.dtype, jnp.floating):
            array = array.astype(jnp.dtype(dtype))
        tensors[hf_name(path)] = np.ascontiguousarray(_to_torch(path, array))
    return tensors
