"""diffusers' SD3Transformer2DModel directories (config.json + diffusion_pytorch_model*.safetensors) in and out.

`PretrainedSD3Transformer.load(directory)` translates config.json into `SD3Transformer` arguments
and renames every tensor into its params (``transformer_blocks.0.attn.to_out.0.weight`` is
``transformer_blocks_0/attn/to_out_0/kernel``); `save(directory)` writes the same layout back, so
diffusers' ``SD3Transformer2DModel.from_pretrained`` reads it. The checkpoint's fixed position
table (``pos_embed.pos_embed``) is not a param: Dew computes it from the config, checks it
against the checkpoint's on load and writes it on save. Calling the bundle runs the model.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.interop.diffusers_models import call_denoiser, check_wrapped, read_model_folder, write_model_folder
from dew.interop.safetensors_io import DIFFUSERS_STEM, open_checkpoint
from dew.interop.weight_map import expected_params, read_params, torch_tensors
from dew.nn.backbones.sd3_transformer import QK_NORMS, SD3Transformer, grid_positions, position_table

CLASS_NAME = "SD3Transformer2DModel"
POSITIONS = "pos_embed.pos_embed"  # the persistent buffer diffusers saves with the weights

# config.json keys SD3Transformer takes under the same name, with diffusers' defaults for absent keys
_SETTINGS = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=18, attention_head_dim=64,
                 num_attention_heads=18, joint_attention_dim=4096, pooled_projection_dim=2048,
                 out_channels=16, pos_embed_max_size=96, dual_attention_layers=(), qk_norm=None)
# a flax name -> its diffusers name, where they differ by more than "_<index>" -> ".<index>"
_RENAMES = {"to_out_0": "to_out.0", "net_0_proj": "net.0.proj", "net_2": "net.2", "kernel": "weight",
            "scale": "weight"}
_TOLERANCE = 1e-5  # how far a float32 checkpoint's position table may sit from the one Dew computes


def model_kwargs(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """SD3Transformer arguments from a diffusers config.json, refusing settings Dew does not implement."""
    if config.get("_class_name", CLASS_NAME) != CLASS_NAME:
        raise ValueError(
            f"{where} describes a {config['_class_name']}, not an {CLASS_NAME}; Dew loads diffusers' "
            f"{CLASS_NAME} (SD3 / SD3.5). For a whole pipeline, point at its transformer/ folder"
        )
    known = set(_SETTINGS) | {"caption_projection_dim"}
    unknown = sorted(key for key in config if not key.startswith("_") and key not in known)
    if unknown:
        raise ValueError(
            f"{where} sets {', '.join(f'{key}={config[key]!r}' for key in unknown)}, which Dew's "
            f"SD3Transformer does not implement; it reads {sorted(known)}"
        )
    kwargs = {key: config.get(key, default) for key, default in _SETTINGS.items()}
    if kwargs["out_channels"] is None:  # diffusers' fallback
        kwargs["out_channels"] = kwargs["in_channels"]
    kwargs["dual_attention_layers"] = tuple(int(i) for i in kwargs["dual_attention_layers"] or ())
    if kwargs["qk_norm"] not in QK_NORMS:
        raise ValueError(f"{where} has qk_norm={kwargs['qk_norm']!r}; Dew's SD3Transformer implements "
                         f"{list(QK_NORMS)}")
    if kwargs["pos_embed_max_size"] is None:
        raise ValueError(f"{where} has pos_embed_max_size=None (positions interpolated to each input "
                         "size); Dew's SD3Transformer implements SD3's cropped table only")
    inner = kwargs["num_attention_heads"] * kwargs["attention_head_dim"]
    caption = config.get("caption_projection_dim", 1152)
    if caption != inner:
        raise ValueError(
            f"{where} has caption_projection_dim={caption}, but the text stream joins attention at "
            f"num_attention_heads * attention_head_dim = {inner}; diffusers needs them equal too"
        )
    return kwargs


def diffusers_config(model: SD3Transformer) -> dict[str, Any]:
    """The config.json diffusers builds ``model``'s structure from."""
    config = {"_class_name": CLASS_NAME, "caption_projection_dim": model.inner_dim}
    config.update({key: getattr(model, key) for key in _SETTINGS})
    config["dual_attention_layers"] = list(model.dual_attention_layers)
    return config


def diffusers_name(path: tuple[str, ...]) -> str:
    """A param path -> its checkpoint name (``transformer_blocks_0/ff/net_2/kernel`` -> ``...0.ff.net.2.weight``)."""
    names = []
    for part in path:
        part = _RENAMES.get(part, part)
        names.append(re.sub(r"^(transformer_blocks)_(\d+)$", r"\1.\2", part))
    return ".".join(names)


def example_inputs(model: SD3Transformer) -> tuple[Any, ...]:
    """The smallest (x, timesteps, conditions) the model takes: what tracing its params needs."""
    side = model.patch_size
    conditions = {"encoder_hidden_states": jnp.zeros((1, 1, model.joint_attention_dim)),
                  "pooled_projections": jnp.zeros((1, model.pooled_projection_dim))}
    return jnp.zeros((1, side, side, model.in_channels)), jnp.zeros((1,)), conditions


def _positions(model: SD3Transformer) -> np.ndarray:
    """The [1, pos_embed_max_size^2, inner_dim] table diffusers stores as ``pos_embed.pos_embed``."""
    return position_table(model.inner_dim, model.pos_embed_max_size, model.sample_size // model.patch_size)[None]


def _check_positions(checkpoint: Mapping[str, np.ndarray], model: SD3Transformer, where: str) -> None:
    """The checkpoint's position table must be the one the config implies (Dew computes, never reads, it).

    Compared a band of rows at a time: SD3.5-medium's table alone is 384^2 x 1536 values.
    """
    if POSITIONS not in checkpoint:
        return  # diffusers rebuilds it from the config too
    size, features = model.pos_embed_max_size, model.inner_dim
    stored = checkpoint[POSITIONS]
    if tuple(stored.shape) != (1, size * size, features):
        raise ValueError(
            f"{POSITIONS!r} in {where} has shape {list(stored.shape)}, but config.json implies "
            f"[1, {size * size}, {features}] (pos_embed_max_size={size}, width {features})"
        )
    tolerance = max(_TOLERANCE, float(jnp.finfo(stored.dtype).eps))  # released SD3 weights are float16
    band = max(1, 2 ** 20 // (size * features))
    for top in range(0, size, band):
        height = min(band, size - top)
        expected = grid_positions(features, size, model.sample_size // model.patch_size, top, 0, height, size)
        rows = np.asarray(stored[0, top * size: (top + height) * size], np.float32)
        if np.abs(rows - expected).max() > tolerance:
            raise ValueError(
                f"{POSITIONS!r} in {where} is not the sin/cos table its config.json implies (sample_size="
                f"{model.sample_size}, patch_size={model.patch_size}, pos_embed_max_size={size}); check "
                "the weights belong to this config"
            )


@dataclasses.dataclass(frozen=True, eq=False)
class PretrainedSD3Transformer:
    """An `SD3Transformer` with its weights, read from or written to diffusers' layout.

    Attributes:
      model: the SD3Transformer.
      variables: ``{"params": ...}``.
      config: the diffusers config.json as a dict.
    """

    model: SD3Transformer
    variables: Mapping[str, Any]
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, directory: str | Path, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
             revision: str | None = None) -> "PretrainedSD3Transformer":
        """Read a diffusers SD3Transformer2DModel directory (or a Hub id's snapshot in the local cache)."""
        path, config, config_path = read_model_folder(directory, revision=revision, what="SD3 transformer",
                                                      class_name=CLASS_NAME, folder="transformer")
        model = SD3Transformer(**model_kwargs(config, str(config_path)), dtype=dtype, param_dtype=param_dtype)
        model.check_settings()
        checkpoint = open_checkpoint(path, stem=DIFFUSERS_STEM)
        _check_positions(checkpoint, model, str(path))
        params = read_params(checkpoint, expected_params(model, *example_inputs(model)), diffusers_name,
                             where=str(path), param_dtype=param_dtype, ignored=lambda name: name == POSITIONS)
        return cls(model=model, variables={"params": params}, config=config)

    @classmethod
    def from_model(cls, model: SD3Transformer, variables: Mapping[str, Any]) -> "PretrainedSD3Transformer":
        """Wrap an SD3Transformer trained or fine-tuned in Dew, to save it for diffusers."""
        check_wrapped("PretrainedSD3Transformer", SD3Transformer, model, variables)
        return cls(model=model, variables=variables, config=diffusers_config(model))

    def save(self, directory: str | Path, *, overwrite: bool = False, dtype: Any = None) -> Path:
        """Write config.json and diffusion_pytorch_model.safetensors (``dtype`` casts the weights).

        Files are written to a hidden sibling directory renamed into place at the end; a non-empty
        ``directory`` is replaced only with ``overwrite=True``.
        """
        expected = expected_params(self.model, *example_inputs(self.model))
        tensors = torch_tensors(self.variables["params"], expected, diffusers_name, dtype=dtype)
        tensors[POSITIONS] = _positions(self.model).astype(jnp.dtype(dtype) if dtype is not None else np.float32)
        return write_model_folder(directory, {**self.config, **diffusers_config(self.model)}, tensors,
                                  overwrite=overwrite)

    def __call__(self, x: jax.Array, timesteps: jax.Array, conditions: Mapping[str, Any]) -> jax.Array:
        """The velocity for latents x [B, H, W, C] at ``timesteps`` [B] (sigma * 1000), jitted."""
        return call_denoiser(self.model, self.variables, x, timesteps, conditions)
