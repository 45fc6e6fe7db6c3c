"""diffusers' UNet2DConditionModel directories (SD 1.x, SD 2.x, SDXL) in and out.

`PretrainedUNet.load(directory)` translates config.json into `dew.nn.backbones.unet_condition.
UNet2DCondition` arguments and renames every tensor into its params
(``down_blocks.1.attentions.0.transformer_blocks.0.ff.net.0.proj.weight`` is
``down_blocks_1/attentions_0/transformer_blocks_0/ff/net_0/proj/kernel``); `save(directory)`
writes the same layout back, so diffusers' ``UNet2DConditionModel.from_pretrained`` reads it.
Every config.json setting is either translated, checked to hold the value Dew builds, or (for
file metadata such as ``sample_size``) carried along unread; anything else is refused by name.
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
from dew.nn.backbones.unet_condition import UNet2DCondition

CLASS_NAME = "UNet2DConditionModel"

# config.json keys Dew's UNet2DCondition takes as they are, with diffusers' defaults for absent keys
_SETTINGS = dict(
    in_channels=4, out_channels=4, layers_per_block=2, transformer_layers_per_block=1, cross_attention_dim=1280,
    use_linear_projection=False, upcast_attention=False, flip_sin_to_cos=True, freq_shift=0, norm_num_groups=32,
    norm_eps=1e-5, downsample_padding=1, mid_block_scale_factor=1.0, addition_embed_type=None,
    addition_time_embed_dim=None, projection_class_embeddings_input_dim=None,
)
_LISTS = ("block_out_channels", "down_block_types", "up_block_types")
# settings Dew builds one way only: config.json must hold diffusers' default (absent is the default)
_FIXED = dict(
    act_fn="silu", center_input_sample=False, mid_block_type="UNetMidBlock2DCrossAttn", only_cross_attention=False,
    dual_cross_attention=False, class_embed_type=None, num_class_embeds=None, class_embeddings_concat=False,
    encoder_hid_dim=None, encoder_hid_dim_type=None, resnet_time_scale_shift="default",
    resnet_skip_time_act=False, resnet_out_scale_factor=1.0, time_embedding_type="positional",
    time_embedding_dim=None, time_embedding_act_fn=None, timestep_post_act=None, time_cond_proj_dim=None,
    conv_in_kernel=3, conv_out_kernel=3, attention_type="default", cross_attention_norm=None,
    mid_block_only_cross_attention=None, reverse_transformer_layers_per_block=None, num_attention_heads=None,
    dropout=0.0,
)
# read by pipelines or by diffusers' "text" embedding only: kept in the config, not used by the model
_CARRIED = ("sample_size", "addition_embed_type_num_heads")
_LIST_NAMES = re.compile(
    r"^(down_blocks|up_blocks|resnets|attentions|transformer_blocks|downsamplers|upsamplers|net|to_out)_(\d+)$")


def _same(value: Any, default: Any) -> bool:
    if isinstance(default, bool) or default is None:
        return value is default or value == default
    return value == default


def model_kwargs(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """UNet2DCondition arguments from a diffusers config.json, refusing settings Dew does not implement."""
    if config.get("_class_name", CLASS_NAME) != CLASS_NAME:
        raise ValueError(
            f"{where} describes a {config['_class_name']}, not a {CLASS_NAME}; Dew loads diffusers' "
            f"{CLASS_NAME} (the SD 1.x / 2.x / SDXL denoiser). Point at the checkpoint's unet/ folder"
        )
    for key in _LISTS:
        if not config.get(key):
            raise ValueError(f"{where} has no {key}; Dew needs it to build the {CLASS_NAME}")
    for key, default in _FIXED.items():
        if key in config and not _same(config[key], default):
            hint = (" (diffusers itself refuses it: the head count goes in attention_head_dim)"
                    if key == "num_attention_heads" else "")
            raise ValueError(
                f"{where} sets {key}={config[key]!r}; Dew's {CLASS_NAME} implements only {key}={default!r}"
                f"{hint}, so it cannot compute what this checkpoint computes"
            )
    known = set(_SETTINGS) | set(_LISTS) | set(_FIXED) | set(_CARRIED) | {"attention_head_dim"}
    unknown = sorted(key for key in config if key not in known and not key.startswith("_"))
    if unknown:
        raise ValueError(
            f"{where} has settings Dew's {CLASS_NAME} does not know: "
            + ", ".join(f"{key}={config[key]!r}" for key in unknown)
        )
    kwargs = {key: config.get(key, default) for key, default in _SETTINGS.items()}
    for key in ("layers_per_block", "transformer_layers_per_block"):
        if isinstance(kwargs[key], list):
            kwargs[key] = tuple(kwargs[key])
    if not isinstance(kwargs["cross_attention_dim"], int):
        raise ValueError(
            f"{where} sets cross_attention_dim={kwargs['cross_attention_dim']!r}; Dew's {CLASS_NAME} takes "
            "one text width for every block"
        )
    heads = config.get("attention_head_dim", 8)  # diffusers reads this key as the head count
    kwargs["num_attention_heads"] = tuple(heads) if isinstance(heads, list) else heads
    kwargs["block_out_channels"] = tuple(int(b) for b in config["block_out_channels"])
    kwargs["down_block_types"] = tuple(config["down_block_types"])
    kwargs["up_block_types"] = tuple(config["up_block_types"])
    return kwargs


def diffusers_config(model: UNet2DCondition) -> dict[str, Any]:
    """The config.json diffusers builds ``model``'s structure from."""
    def plain(value):
        return list(value) if isinstance(value, (tuple, list)) else value

    config = {"_class_name": CLASS_NAME, **_FIXED}
    config.update({key: plain(getattr(model, key)) for key in _SETTINGS})
    config.update({key: list(getattr(model, key)) for key in _LISTS})
    config["attention_head_dim"] = plain(model.num_attention_heads)
    return config


def diffusers_name(path: tuple[str, ...]) -> str:
    """A param path -> its checkpoint name (``up_blocks_1/resnets_0/norm1/scale`` ->
    ``up_blocks.1.resnets.0.norm1.weight``); ``linear_1`` and ``conv1`` keep their digits."""
    names = []
    for part in "/".join(path).split("/"):
        part = {"kernel": "weight", "scale": "weight"}.get(part, part)
        names.append(_LIST_NAMES.sub(r"\1.\2", part))
    return ".".join(names)


def _example(model: UNet2DCondition) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    side = model.downsampling
    conditions = {"encoder_hidden_states": jnp.zeros((1, 1, model.cross_attention_dim), jnp.float32)}
    if model.addition_embed_type == "text_time":
        ids = 6
        pooled = model.projection_class_embeddings_input_dim - ids * model.addition_time_embed_dim
        conditions["text_embeds"] = jnp.zeros((1, pooled), jnp.float32)
        conditions["time_ids"] = jnp.zeros((1, ids), jnp.float32)
    return jnp.zeros((1, side, side, model.in_channels), jnp.float32), jnp.zeros((1,), jnp.float32), conditions


@dataclasses.dataclass(frozen=True, eq=False)
class PretrainedUNet:
    """A `UNet2DCondition` with its weights, read from or written as a diffusers folder.

    Attributes:
      model: the UNet2DCondition.
      variables: ``{"params": ...}``.
      config: the diffusers config.json as a dict (``sample_size`` tells a pipeline the default
        latent side).
    """

    model: UNet2DCondition
    variables: Mapping[str, Any]
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, directory: str | Path, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
             revision: str | None = None) -> "PretrainedUNet":
        """Read a diffusers UNet2DConditionModel directory (or a Hub id's snapshot in the local cache)."""
        path, config, config_path = read_model_folder(directory, revision=revision, what="UNet",
                                                      class_name=CLASS_NAME, folder="unet")
        model = UNet2DCondition(**model_kwargs(config, str(config_path)), dtype=dtype, param_dtype=param_dtype)
        params = read_params(open_checkpoint(path, stem=DIFFUSERS_STEM), expected_params(model, *_example(model)),
                             diffusers_name, where=str(path), param_dtype=param_dtype)
        return cls(model=model, variables={"params": params}, config=config)

    @classmethod
    def from_model(cls, model: UNet2DCondition, variables: Mapping[str, Any]) -> "PretrainedUNet":
        """Wrap a UNet2DCondition trained in Dew, to save it for diffusers."""
        check_wrapped("PretrainedUNet", UNet2DCondition, model, variables)
        return cls(model=model, variables=variables, config=diffusers_config(model))

    def save(self, directory: str | Path, *, overwrite: bool = False, dtype: Any = None) -> Path:
        """Write config.json and diffusion_pytorch_model.safetensors (``dtype`` casts the weights).

        Files are written to a hidden sibling directory renamed into place at the end; a non-empty
        ``directory`` is replaced only with ``overwrite=True``.
        """
        expected = expected_params(self.model, *_example(self.model))
        tensors = torch_tensors(self.variables["params"], expected, diffusers_name, dtype=dtype)
        return write_model_folder(directory, {**self.config, **diffusers_config(self.model)}, tensors,
                                  overwrite=overwrite)

    def __call__(self, x: jax.Array, timesteps: jax.Array, conditions: Mapping[str, Any]) -> jax.Array:
        """The model's prediction for latents x [B, H, W, C] at ``timesteps`` [B] (0..999)."""
        return call_denoiser(self.model, self.variables, x, timesteps, conditions)
