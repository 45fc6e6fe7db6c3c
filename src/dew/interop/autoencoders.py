"""diffusers' AutoencoderKL directories (config.json + diffusion_pytorch_model.safetensors) in and out.

`PretrainedAutoencoder.load(directory)` translates config.json into `dew.nn.vae.AutoencoderKL`
arguments and renames every tensor into its params (``encoder.down_blocks.0.resnets.1.conv1.weight``
is ``encoder/down_blocks_0/resnets_1/conv1/kernel``); `save(directory)` writes the same layout back,
so diffusers' ``AutoencoderKL.from_pretrained`` reads it. The bundle holds its weights and is an
`Autoencoder` for latent diffusion: `encode(images, key=None)`, `decode(latents)`, `latent_shape`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from dew.interop.diffusers_models import check_wrapped, read_model_folder, write_model_folder
from dew.interop.safetensors_io import DIFFUSERS_STEM, open_checkpoint
from dew.interop.weight_map import expected_params, read_params, torch_tensors
from dew.nn.vae import AutoencoderKL

CLASS_NAME = "AutoencoderKL"

# config.json settings Dew's AutoencoderKL takes as they are, with diffusers' defaults for absent keys
_SETTINGS = dict(in_channels=3, out_channels=3, layers_per_block=1, latent_channels=4, norm_num_groups=32,
                 use_quant_conv=True, use_post_quant_conv=True, mid_block_add_attention=True)
# older diffusers checkpoints name the mid-block attention's projections these ways
_LEGACY_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def model_kwargs(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """AutoencoderKL arguments from a diffusers config.json, refusing settings Dew does not implement."""
    if config.get("_class_name", CLASS_NAME) != CLASS_NAME:
        raise ValueError(
            f"{where} describes a {config['_class_name']}, not an {CLASS_NAME}; Dew loads diffusers' "
            f"{CLASS_NAME} (the SD / SDXL / SD3 / Flux VAE). Point at the checkpoint's vae/ folder"
        )
    blocks = config.get("block_out_channels")
    if not blocks:
        raise ValueError(f"{where} has no block_out_channels; it is not a complete {CLASS_NAME} config")
    expected_blocks = {"down_block_types": "DownEncoderBlock2D", "up_block_types": "UpDecoderBlock2D"}
    for key, block in expected_blocks.items():
        kinds = config.get(key, [block] * len(blocks))
        if list(kinds) != [block] * len(blocks):
            raise ValueError(
                f"{where} has {key}={list(kinds)}; Dew's {CLASS_NAME} builds {len(blocks)} x {block!r} "
                "(one per block_out_channels entry)"
            )
    if config.get("act_fn", "silu") != "silu":
        raise ValueError(f"{where} has act_fn={config['act_fn']!r}; Dew's {CLASS_NAME} uses 'silu'")
    for key in ("latents_mean", "latents_std"):
        if config.get(key) is not None:
            raise ValueError(
                f"{where} sets {key}; Dew's {CLASS_NAME} normalizes latents by scaling_factor and "
                "shift_factor only, so it would hand a diffusion model differently scaled latents"
            )
    kwargs = {key: config.get(key, default) for key, default in _SETTINGS.items()}
    kwargs["block_out_channels"] = tuple(int(b) for b in blocks)
    kwargs["scaling_factor"] = float(config.get("scaling_factor", 0.18215))
    kwargs["shift_factor"] = float(config.get("shift_factor") or 0.0)
    return kwargs


def diffusers_config(model: AutoencoderKL) -> dict[str, Any]:
    """The config.json diffusers builds ``model``'s structure from."""
    levels = len(model.block_out_channels)
    config = {
        "_class_name": CLASS_NAME,
        "act_fn": "silu",
        "block_out_channels": list(model.block_out_channels),
        "down_block_types": ["DownEncoderBlock2D"] * levels,
        "up_block_types": ["UpDecoderBlock2D"] * levels,
        "scaling_factor": model.scaling_factor,
        "shift_factor": model.shift_factor or None,
        "latents_mean": None,
        "latents_std": None,
        "force_upcast": True,
    }
    config.update({key: getattr(model, key) for key in _SETTINGS})
    return config


def diffusers_name(path: tuple[str, ...]) -> str:
    """A param path -> its checkpoint name (``down_blocks_0/resnets_1`` -> ``down_blocks.0.resnets.1``)."""
    names = []
    for part in "/".join(path).split("/"):
        part = {"downsample": "downsamplers.0.conv", "upsample": "upsamplers.0.conv",
                "attention": "attentions.0", "to_out": "to_out.0", "kernel": "weight",
                "scale": "weight"}.get(part, part)
        names.append(re.sub(r"_(\d+)$", r".\1", part))
    return ".".join(names)


def _modern_name(name: str) -> str:
    """A checkpoint name with the old attention names (query, proj_attn, ...) replaced."""
    parts = name.split(".")
    if "attentions" in parts and len(parts) >= 2 and parts[-2] in _LEGACY_ATTENTION:
        parts[-2] = _LEGACY_ATTENTION[parts[-2]]
    return ".".join(parts)


def _example(model: AutoencoderKL) -> jax.Array:
    side = model.downsampling
    return jnp.zeros((1, side, side, model.in_channels), jnp.float32)


@functools.partial(jax.jit, static_argnums=0)
def _encode(model: AutoencoderKL, variables: Any, images: jax.Array, key: jax.Array | None) -> jax.Array:
    return model.apply(variables, images, key, method=AutoencoderKL.encode)


@functools.partial(jax.jit, static_argnums=0)
def _decode(model: AutoencoderKL, variables: Any, latents: jax.Array) -> jax.Array:
    return model.apply(variables, latents, method=AutoencoderKL.decode)


@dataclasses.dataclass(frozen=True, eq=False)
class PretrainedAutoencoder:
    """An `AutoencoderKL` with its weights: the `Autoencoder` latent diffusion encodes with.

    Attributes:
      model: the AutoencoderKL.
      variables: ``{"params": ...}``.
      config: the diffusers config.json as a dict.
    """

    model: AutoencoderKL
    variables: Mapping[str, Any]
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, directory: str | Path, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
             revision: str | None = None) -> "PretrainedAutoencoder":
        """Read a diffusers AutoencoderKL directory (or a Hub id's snapshot in the local cache)."""
        path, config, config_path = read_model_folder(directory, revision=revision, what="autoencoder",
                                                      class_name=CLASS_NAME, folder="vae")
        model = AutoencoderKL(**model_kwargs(config, str(config_path)), dtype=dtype, param_dtype=param_dtype)
        checkpoint = open_checkpoint(path, stem=DIFFUSERS_STEM)
        checkpoint = {_modern_name(name): checkpoint[name] for name in checkpoint}
        params = read_params(checkpoint, expected_params(model, _example(model)), diffusers_name,
                             where=str(path), param_dtype=param_dtype)
        return cls(model=model, variables={"params": params}, config=config)

    @classmethod
    def from_model(cls, model: AutoencoderKL, variables: Mapping[str, Any]) -> "PretrainedAutoencoder":
        """Wrap an AutoencoderKL trained in Dew, to encode with it or save it for diffusers."""
        check_wrapped("PretrainedAutoencoder", AutoencoderKL, model, variables)
        return cls(model=model, variables=variables, config=diffusers_config(model))

    def save(self, directory: str | Path, *, overwrite: bool = False, dtype: Any = None) -> Path:
        """Write config.json and diffusion_pytorch_model.safetensors (``dtype`` casts the weights).

        Files are written to a hidden sibling directory renamed into place at the end; a non-empty
        ``directory`` is replaced only with ``overwrite=True``.
        """
        expected = expected_params(self.model, _example(self.model))
        tensors = torch_tensors(self.variables["params"], expected, diffusers_name, dtype=dtype)
        return write_model_folder(directory, {**self.config, **diffusers_config(self.model)}, tensors,
                                  overwrite=overwrite)

    # --- the Autoencoder protocol -----------------------------------------------------------------

    def encode(self, images: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """Scaled latents of images in [-1, 1] [B, H, W, C]: the posterior mean, or a draw with ``key``."""
        return _encode(self.model, self.variables, images, key)

    def decode(self, latents: jax.Array) -> jax.Array:
        """Images (about [-1, 1]) from scaled latents."""
        return _decode(self.model, self.variables, latents)

    def latent_shape(self, sample_shape: tuple[int, ...]) -> tuple[int, ...]:
        return self.model.latent_shape(tuple(sample_shape))
