"""diffusers' FluxTransformer2DModel directories (a FLUX.1 checkpoint's transformer/ folder) in and out.

`PretrainedFluxTransformer.load(directory)` translates config.json into `dew.nn.backbones.
flux_transformer.FluxTransformer` arguments and renames every tensor into its params
(``transformer_blocks.0.ff.net.0.proj.weight`` is ``transformer_blocks_0/ff/net_0_proj/kernel``);
weights may be one diffusion_pytorch_model.safetensors or the shards its index lists (FLUX.1-dev
ships three). `save(directory)` writes diffusers' layout back, so ``FluxTransformer2DModel.
from_pretrained`` reads it. Calling the bundle runs the model on plain latents [B, H, W, C].
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from dew.interop.diffusers_models import call_denoiser, check_wrapped, read_model_folder, write_model_folder
from dew.interop.safetensors_io import DIFFUSERS_STEM, open_checkpoint
from dew.interop.weight_map import expected_params, read_params, torch_tensors
from dew.nn.backbones.flux_transformer import FluxTransformer

CLASS_NAME = "FluxTransformer2DModel"

# config.json settings FluxTransformer takes by the same name, with diffusers' defaults for absent keys
_SETTINGS = dict(in_channels=64, out_channels=None, num_layers=19, num_single_layers=38, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                 guidance_embeds=False, axes_dims_rope=(16, 56, 56))
# param path parts whose checkpoint names differ beyond "_N" list indices
_PARTS = {"to_out_0": "to_out.0", "net_0_proj": "net.0.proj", "net_2": "net.2", "kernel": "weight", "scale": "weight"}


def model_kwargs(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """FluxTransformer arguments from a diffusers config.json, refusing settings Dew does not implement."""
    if config.get("_class_name", CLASS_NAME) != CLASS_NAME:
        raise ValueError(
            f"{where} describes a {config['_class_name']}, not a {CLASS_NAME}; point at a FLUX.1 "
            "checkpoint's transformer/ folder"
        )
    if config.get("patch_size", 1) != 1:
        raise ValueError(
            f"{where} has patch_size={config['patch_size']!r}; Dew's FluxTransformer embeds FluxPipeline's "
            "2x2-packed latents token by token (patch_size=1, as every FLUX.1 checkpoint)"
        )
    unknown = {key: value for key, value in config.items()
               if not key.startswith("_") and key != "patch_size" and key not in _SETTINGS}
    if unknown:
        raise ValueError(
            f"{where} sets {', '.join(f'{k}={v!r}' for k, v in sorted(unknown.items()))}, which Dew's "
            f"FluxTransformer does not implement; it reads {sorted(_SETTINGS) + ['patch_size']}"
        )
    kwargs = {key: config.get(key, default) for key, default in _SETTINGS.items()}
    kwargs["axes_dims_rope"] = tuple(int(d) for d in kwargs["axes_dims_rope"])
    kwargs["guidance_embeds"] = bool(kwargs["guidance_embeds"])
    return kwargs


def diffusers_config(model: FluxTransformer) -> dict[str, Any]:
    """The config.json diffusers builds ``model``'s structure from."""
    config = {"_class_name": CLASS_NAME, "patch_size": 1}
    config.update({key: getattr(model, key) for key in _SETTINGS})
    config["axes_dims_rope"] = list(model.axes_dims_rope)
    return config


def diffusers_name(path: tuple[str, ...]) -> str:
    """A param path -> its checkpoint name (``single_transformer_blocks_3/attn/norm_q/scale`` ->
    ``single_transformer_blocks.3.attn.norm_q.weight``)."""
    names = []
    for part in path:
        part = _PARTS.get(part, part)
        names.append(re.sub(r"^((?:single_)?transformer_blocks)_(\d+)$", r"\1.\2", part))
    return ".".join(names)


def example_inputs(model: FluxTransformer) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """The smallest inputs ``model`` takes (one 2x2 latent, one text token): to trace its params."""
    conditions = {"encoder_hidden_states": jnp.zeros((1, 1, model.joint_attention_dim)),
                  "pooled_projections": jnp.zeros((1, model.pooled_projection_dim))}
    if model.guidance_embeds:
        conditions["guidance"] = jnp.zeros((1,))
    return jnp.zeros((1, 2, 2, model.in_channels // 4)), jnp.zeros((1,)), conditions


@dataclasses.dataclass(frozen=True, eq=False)
class PretrainedFluxTransformer:
    """A `FluxTransformer` with its weights: FLUX.1's denoiser.

    Attributes:
      model: the FluxTransformer.
      variables: ``{"params": ...}``.
      config: the diffusers config.json as a dict.
    """

    model: FluxTransformer
    variables: Mapping[str, Any]
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, directory: str | Path, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
             revision: str | None = None) -> "PretrainedFluxTransformer":
        """Read a diffusers FluxTransformer2DModel directory (or a Hub id's snapshot in the local cache)."""
        path, config, config_path = read_model_folder(directory, revision=revision, what="Flux transformer",
                                                      class_name=CLASS_NAME, folder="transformer")
        model = FluxTransformer(**model_kwargs(config, str(config_path)), dtype=dtype, param_dtype=param_dtype)
        checkpoint = open_checkpoint(path, stem=DIFFUSERS_STEM)
        params = read_params(checkpoint, expected_params(model, *example_inputs(model)), diffusers_name,
                             where=str(path), param_dtype=param_dtype)
        return cls(model=model, variables={"params": params}, config=config)

    @classmethod
    def from_model(cls, model: FluxTransformer, variables: Mapping[str, Any]) -> "PretrainedFluxTransformer":
        """Wrap a FluxTransformer trained in Dew, to run it or save it for diffusers."""
        check_wrapped("PretrainedFluxTransformer", FluxTransformer, model, variables)
        return cls(model=model, variables=variables, config=diffusers_config(model))

    def save(self, directory: str | Path, *, overwrite: bool = False, dtype: Any = None) -> Path:
        """Write config.json and diffusion_pytorch_model.safetensors (``dtype`` casts the weights).

        Files are written to a hidden sibling directory renamed into place at the end; a non-empty
        ``directory`` is replaced only with ``overwrite=True``.
        """
        expected = expected_params(self.model, *example_inputs(self.model))
        tensors = torch_tensors(self.variables["params"], expected, diffusers_name, dtype=dtype)
        return write_model_folder(directory, {**self.config, **diffusers_config(self.model)}, tensors,
                                  overwrite=overwrite)

    def __call__(self, x: jax.Array, timesteps: jax.Array, conditions: Mapping[str, jax.Array]) -> jax.Array:
        """The flow velocity [B, H, W, C] for latents ``x`` at ``timesteps`` (t / 1000), jitted."""
        return call_denoiser(self.model, self.variables, x, timesteps, conditions)
