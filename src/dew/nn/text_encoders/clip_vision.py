"""CLIP's image tower (Radford et al. 2021), the partner of the text tower in clip.py, whose blocks it
shares: what CLIPScore embeds generated images with.

    x = [class_embedding; patch_embedding(pixels)] + position_embedding[0..1 + (S / P)^2)
    x = pre_layrnorm(x)
    num_layers x pre-norm blocks, attending over every token (not causal)
    pooled = post_layernorm(x[:, 0])          the class token's final state
    projected = visual_projection(pooled)    (no bias)

Pixels are [B, S, S, 3] already through CLIP's preprocessing (resized, cropped, normalized with
CLIP's mean and std: `dew.eval.clip_score.clip_pixels`). `last` is transformers'
``last_hidden_state`` (not post-normed).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from dew.nn.embeddings import dense
from dew.nn.text_encoders.clip import CLIPEncoderLayer, layer_norm


@flax.struct.dataclass
class CLIPVisionOutput:
    """What `CLIPVisionEncoder` returns: last [B, 1 + patches, D], pooled [B, D], and projected
    [B, projection_dim] (None for a model without a projection)."""

    last: jax.Array
    pooled: jax.Array
    projected: jax.Array | None = None


class CLIPVisionEncoder(nn.Module):
    """CLIPVisionModel, or CLIPVisionModelWithProjection when ``projection_dim`` is set.

    Defaults are OpenAI's ViT-L/14 image tower at 224 pixels. Called on preprocessed pixels
    [B, image_size, image_size, 3], it returns a `CLIPVisionOutput`.
    """

    image_size: int = 224
    patch_size: int = 14
    num_channels: int = 3
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_layers: int = 24
    num_heads: int = 16
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    projection_dim: int | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def _check(self, pixels: jax.Array) -> None:
        expected = (self.image_size, self.image_size, self.num_channels)
        if pixels.ndim != 4 or tuple(pixels.shape[1:]) != expected:
            raise ValueError(
                f"CLIPVisionEncoder takes preprocessed pixels [batch, {', '.join(map(str, expected))}]; got "
                f"shape {tuple(pixels.shape)}. Resize and crop images to the tower's size first (clip_pixels)"
            )
        if self.image_size % self.patch_size:
            raise ValueError(f"CLIPVisionEncoder: image_size={self.image_size} is not a multiple of patch_size={self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"CLIPVisionEncoder: hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")

    @nn.compact
    def __call__(self, pixels: jax.Array) -> CLIPVisionOutput:
        self._check(pixels)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        init = nn.initializers.normal(0.02)
        patches = nn.Conv(self.hidden_size, (self.patch_size, self.patch_size), strides=self.patch_size,
                          padding="VALID", use_bias=False, name="patch_embedding", **kw,
                          kernel_init=nn.with_logical_partitioning(init, (None, None, None, "embed")))(pixels)
        batch = patches.shape[0]
        patches = patches.reshape(batch, -1, self.hidden_size)  # row-major over the grid, as torch's flatten
        class_embedding = self.param("class_embedding", nn.with_logical_partitioning(init, ("embed",)),
                                     (self.hidden_size,), self.param_dtype)
        x = jnp.concatenate([jnp.broadcast_to(class_embedding.astype(patches.dtype), (batch, 1, self.hidden_size)),
                             patches], axis=1)
        positions = nn.Embed(x.shape[1], self.hidden_size, name="position_embedding", **kw,
                             embedding_init=nn.with_logical_partitioning(init, (None, "embed")))
        x = x + positions(jnp.arange(x.shape[1]))[None]
        x = layer_norm(self.layer_norm_eps, "pre_layrnorm", **kw)(x)
        for i in range(self.num_layers):
            x = CLIPEncoderLayer(self.num_heads, self.intermediate_size, self.hidden_act, self.layer_norm_eps,
                                 causal=False, name=f"layers_{i}", **kw)(x, None)
        pooled = layer_norm(self.layer_norm_eps, "post_layernorm", **kw)(x[:, 0])
        projected = None
        if self.projection_dim is not None:
            projected = dense(self.projection_dim, ("embed", None), "visual_projection", use_bias=False, **kw)(pooled)
        return CLIPVisionOutput(last=x, pooled=pooled, projected=projected)
