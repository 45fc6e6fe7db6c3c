"""What every diffusers model folder Dew reads shares: config.json beside
diffusion_pytorch_model.safetensors (or its sharded index), written back the same way.

`PretrainedAutoencoder`, `PretrainedUNet`, `PretrainedSD3Transformer` and
`PretrainedFluxTransformer` translate their own config and tensor names; finding the folder,
checking a model handed to `from_model`, writing the folder atomically and calling a denoiser are
the same for all of them and live here.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from dew.files import staged_directory
from dew.hub import local_directory
from dew.interop.safetensors_io import DIFFUSERS_FILE, DIFFUSERS_INDEX, save_file

CONFIG_FILE = "config.json"


def read_model_folder(directory: str | Path, *, revision: str | None, what: str, class_name: str,
                      folder: str) -> tuple[Path, dict[str, Any], Path]:
    """``(path, config, config_path)`` of a diffusers model folder (or a Hub id's snapshot in the
    local cache). Raises FileNotFoundError saying what the folder needs and, for a whole pipeline,
    which of its folders (`folder`, e.g. "unet") to point at."""
    path = local_directory(directory, revision=revision, what=what)
    config_path = path / CONFIG_FILE
    if not config_path.is_file() or not ((path / DIFFUSERS_FILE).is_file() or (path / DIFFUSERS_INDEX).is_file()):
        present = sorted(p.name for p in path.iterdir())[:12] if path.is_dir() else []
        raise FileNotFoundError(
            f"{path} is not a diffusers {class_name} directory: it needs {CONFIG_FILE} and {DIFFUSERS_FILE} "
            f"(or {DIFFUSERS_INDEX} with its shards) and holds {present}. For a whole pipeline, point at "
            f"its {folder}/ folder"
        )
    return path, json.loads(config_path.read_text()), config_path


def check_wrapped(bundle: str, model_type: type, model: Any, variables: Any) -> None:
    """Refuse a `from_model` call whose model is not a `model_type` or whose variables hold no params."""
    if not isinstance(model, model_type):
        raise TypeError(f"{bundle} wraps a {model_type.__name__}; got {type(model).__name__}")
    if not isinstance(variables, Mapping) or "params" not in variables:
        got = sorted(variables) if isinstance(variables, Mapping) else type(variables).__name__
        raise ValueError(f"variables must be the Flax mapping with a 'params' collection; got {got}")


def write_model_folder(directory: str | Path, config: Mapping[str, Any], tensors: Mapping[str, Any], *,
                       overwrite: bool) -> Path:
    """Write config.json and diffusion_pytorch_model.safetensors into a hidden sibling directory
    renamed into place at the end; a non-empty `directory` is replaced only with ``overwrite=True``."""
    dest = Path(directory).expanduser()
    with staged_directory(dest, overwrite=overwrite) as staging:
        (staging / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
        save_file(dict(tensors), staging / DIFFUSERS_FILE, metadata={"format": "pt"})
    return dest


@functools.partial(jax.jit, static_argnums=0)
def _apply(model: Any, variables: Any, x: jax.Array, timesteps: jax.Array,
           conditions: Mapping[str, jax.Array]) -> jax.Array:
    return model.apply(variables, x, timesteps, conditions)


def call_denoiser(model: Any, variables: Any, x: Any, timesteps: Any, conditions: Mapping[str, Any]) -> jax.Array:
    """A denoiser's output for latents x [B, H, W, C] at float `timesteps` [B], jitted once per model."""
    conditions = {key: jnp.asarray(value) for key, value in conditions.items()}
    return _apply(model, variables, jnp.asarray(x), jnp.asarray(timesteps, jnp.float32), conditions)
