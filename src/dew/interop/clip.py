"""transformers CLIPModel directories in: both towers, both projections and the logit scale.

`PretrainedCLIP.load(directory)` reads a CLIPModel (``model_type == "clip"``) or a lone
CLIPVisionModel / CLIPVisionModelWithProjection (``clip_vision_model``, no text tower). The text
tower and its tokenizer load as a `PretrainedTextEncoder` (text_encoders.py); the image tower as a
`CLIPVisionEncoder` whose tensors are named ``vision_model.*`` and ``visual_projection.weight``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.hub import local_directory
from dew.interop.safetensors_io import open_checkpoint
from dew.interop.text_encoders import CONFIG_FILE, PretrainedTextEncoder
from dew.interop.weight_map import expected_params, read_params
from dew.nn.text_encoders.clip_vision import CLIPVisionEncoder, CLIPVisionOutput

MODEL_TYPES = ("clip", "clip_vision_model")

# transformers' CLIPVisionConfig defaults, for the keys a config.json may leave out
VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, projection_dim=512, num_hidden_layers=12,
                       num_attention_heads=12, num_channels=3, image_size=224, patch_size=32,
                       hidden_act="quick_gelu", layer_norm_eps=1e-5)


def vision_kwargs(config: Mapping[str, Any], has_projection: bool) -> dict[str, Any]:
    """CLIPVisionEncoder arguments from a CLIPVisionConfig (or a CLIPConfig's vision_config)."""
    vision = (config.get("vision_config") or {}) if config.get("model_type") == "clip" else config
    vision = {**VISION_DEFAULTS, **{key: value for key, value in vision.items() if value is not None}}
    kwargs = dict(
        image_size=vision["image_size"], patch_size=vision["patch_size"], num_channels=vision["num_channels"],
        hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
        num_layers=vision["num_hidden_layers"], num_heads=vision["num_attention_heads"],
        hidden_act=vision["hidden_act"], layer_norm_eps=vision["layer_norm_eps"],
    )
    if has_projection:
        kwargs["projection_dim"] = config.get("projection_dim") or vision["projection_dim"]
    return kwargs


def vision_name(path: tuple[str, ...]) -> str:
    """``layers_1/mlp/fc1/kernel`` -> ``vision_model.encoder.layers.1.mlp.fc1.weight``."""
    head, *rest = "/".join(path).split("/")
    if head == "visual_projection":
        return "visual_projection.weight"
    if head == "class_embedding":
        return "vision_model.embeddings.class_embedding"
    if head in ("patch_embedding", "position_embedding"):
        head = f"embeddings.{head}"
    elif head.startswith("layers_"):
        head = f"encoder.layers.{head.removeprefix('layers_')}"
    leaf = {"kernel": "weight", "scale": "weight", "embedding": "weight"}.get(rest[-1], rest[-1])
    return ".".join(["vision_model", head, *rest[:-1], leaf])


def _vision_ignored(name: str) -> bool:
    """The text tower and the logit scale of a CLIPModel, and older versions' position-id buffers."""
    return name.startswith(("text_model.", "text_projection.", "logit_scale")) or name.endswith(".position_ids")


@functools.partial(jax.jit, static_argnums=0)
def _apply(model: Any, variables: Any, pixels: jax.Array) -> Any:
    return model.apply(variables, pixels)


@dataclasses.dataclass(frozen=True, eq=False)
class PretrainedCLIP:
    """A CLIP model: the image tower, and the text tower when the directory has one.

    Attributes:
      vision: the `CLIPVisionEncoder` module; vision_variables: ``{"params": ...}`` for it.
      text: the text tower and its tokenizer (a `PretrainedTextEncoder`), or None for a lone image tower.
      logit_scale: the learned temperature's log (CLIPModel's ``logit_scale``), or None without one.
      config: the transformers config.json as a dict.
    """

    vision: CLIPVisionEncoder
    vision_variables: Mapping[str, Any]
    text: PretrainedTextEncoder | None = None
    logit_scale: float | None = None
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, directory: str | Path, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
             revision: str | None = None) -> "PretrainedCLIP":
        """Read a transformers CLIPModel directory (or a Hub id's snapshot in the local cache)."""
        path = local_directory(directory, revision=revision, what="CLIP model")
        config_path = path / CONFIG_FILE
        if not config_path.is_file():
            raise FileNotFoundError(f"no {CONFIG_FILE} in {path}; a transformers CLIPModel directory holds it")
        config = json.loads(config_path.read_text())
        model_type = config.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"{config_path} has model_type={model_type!r}; PretrainedCLIP loads {list(MODEL_TYPES)} "
                "(CLIPModel, CLIPVisionModel, CLIPVisionModelWithProjection). For a text tower alone use "
                "PretrainedTextEncoder.load"
            )
        checkpoint = open_checkpoint(path)
        vision = CLIPVisionEncoder(**vision_kwargs(config, "visual_projection.weight" in checkpoint),
                                   dtype=dtype, param_dtype=param_dtype)
        example = jnp.zeros((1, vision.image_size, vision.image_size, vision.num_channels), jnp.float32)
        params = read_params(checkpoint, expected_params(vision, example), vision_name, where=str(path),
                             param_dtype=param_dtype, ignored=_vision_ignored)
        text = None
        if model_type == "clip":
            text = PretrainedTextEncoder.load(path, dtype=dtype, param_dtype=param_dtype)
        scale = float(np.asarray(checkpoint["logit_scale"])) if "logit_scale" in checkpoint else None
        return cls(vision=vision, vision_variables={"params": params}, text=text, logit_scale=scale, config=config)

    def encode_pixels(self, pixels: jax.Array) -> CLIPVisionOutput:
        """Preprocessed pixels [B, S, S, 3] -> the image tower's `CLIPVisionOutput`."""
        return _apply(self.vision, self.vision_variables, jnp.asarray(pixels))

    def encode_texts(self, texts: Sequence[str]) -> Any:
        """Captions -> the text tower's `CLIPTextOutput`."""
        if self.text is None:
            raise ValueError("this CLIP directory holds an image tower only; load a CLIPModel for text")
        return self.text(texts)
