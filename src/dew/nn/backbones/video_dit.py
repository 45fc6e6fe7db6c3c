"""VideoDiT: a diffusion transformer over clips with factorized space-time attention (the
"factorized self-attention" of ViViT, Arnab et al. 2021, and Latte, Ma et al. 2024, in DiT's
adaLN-zero form).

    x [B, T, H, W, C] -> patch_embed (tubelet x p x p conv) + fixed 3-D sin/cos positions
                      -> tokens [B, t, h, w, D]      (t = T / tubelet, h = H / p, w = W / p)
    c = noise_embed(noise_input) + label_embed(label) + condition_embed(embedding)
    num_layers x video_dit_block_i:
        spatial attention:  the h*w tokens of each frame attend to each other
        temporal attention: the t tokens at each spatial location attend to each other
        MLP; each of the three modulated and gated from c (adaLN-zero)
    final_layer -> unpatchify -> [B, T, H, W, C]

A fresh model outputs exactly 0. One block already connects every token to every other: space
then time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn.attention import check_attention_impl
from dew.nn.backbones.dit import check_image
from dew.nn.embeddings import (
    ConditionVector,
    PatchEmbedding,
    check_channels,
    check_conditions,
    check_patch_grid,
    pooled_condition_keys,
    sincos_positions,
    unpatchify,
)
from dew.nn.vit import FinalLayer, MlpBlock, Modulation, SelfAttention, gated, layer_norm, modulate


class FactorizedBlock(nn.Module):
    """Spatial attention, temporal attention and MLP over tokens [B, t, h, w, D], adaLN-zero.

    ``modulation`` chunks, in order: shift/scale/gate for spatial attention, the same for
    temporal attention, the same for the MLP (9 vectors of width D).
    """

    num_heads: int
    mlp_ratio: float = 4.0
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, c: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        batch, frames, height, width, features = x.shape
        mod = Modulation(9, features, name="modulation", **kw)(c)
        tokens = x.reshape(batch, frames * height * width, features)

        # space: one sequence of h*w tokens per (example, frame)
        h = modulate(layer_norm("norm_spatial", **kw)(tokens), mod[0], mod[1])
        h = h.reshape(batch * frames, height * width, features)
        h = SelfAttention(self.num_heads, self.attention_impl, name="spatial_attn", **kw)(h)
        tokens = gated(tokens, mod[2], h.reshape(batch, -1, features))

        # time: one sequence of t tokens per (example, spatial location)
        h = modulate(layer_norm("norm_temporal", **kw)(tokens), mod[3], mod[4])
        h = h.reshape(batch, frames, height * width, features).transpose(0, 2, 1, 3)
        h = SelfAttention(self.num_heads, self.attention_impl, name="temporal_attn", **kw)(
            h.reshape(batch * height * width, frames, features))
        h = h.reshape(batch, height * width, frames, features).transpose(0, 2, 1, 3)
        tokens = gated(tokens, mod[5], h.reshape(batch, -1, features))

        h = modulate(layer_norm("norm_mlp", **kw)(tokens), mod[6], mod[7])
        tokens = gated(tokens, mod[8], MlpBlock(self.mlp_ratio, name="mlp", **kw)(h))
        return tokens.reshape(x.shape)


class VideoDiT(nn.Module):
    """DiT over clips [B, T, H, W, C]: T a multiple of ``tubelet_size``, H and W of ``patch_size``.

    Output has the input's shape ([B, T, H, W, 2C] with ``learn_sigma``). Conditions as
    `SimpleDiT`: "label" with num_classes, "embedding" with condition_features.
    """

    patch_size: int
    tubelet_size: int
    emb_features: int
    num_layers: int
    num_heads: int
    mlp_ratio: float = 4.0
    num_classes: int | None = None
    condition_features: int | None = None
    learn_sigma: bool = False
    noise_scale: float = 1000.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    attention_impl: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array, noise_input: jax.Array,
                 conditions: Mapping[str, Any] | None = None) -> jax.Array:
        name = type(self).__name__
        check_attention_impl(self.attention_impl)
        check_image(x, 5, name, "[batch, frames, height, width, channels]")
        accepted = pooled_condition_keys(self.num_classes, self.condition_features)
        conditions = check_conditions(conditions, accepted, name)
        batch, frames, height, width, channels = x.shape
        patch = (self.tubelet_size, self.patch_size, self.patch_size)
        grid = check_patch_grid((frames, height, width), patch, ("frames", "height", "width"), name)
        check_channels(self, channels, ("patch_embed", "proj", "kernel"), -2, name)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)

        c = ConditionVector(
            self.emb_features, self.num_classes, self.condition_features, self.noise_scale,
            model=name, name="conditioning", **kw,
        )(noise_input, conditions, batch)

        tokens = PatchEmbedding(self.emb_features, patch, name="patch_embed", **kw)(x.astype(self.dtype))
        positions = jnp.asarray(sincos_positions(self.emb_features, grid), self.dtype)
        tokens = tokens + positions.reshape(*grid, self.emb_features)[None]

        for i in range(self.num_layers):
            tokens = FactorizedBlock(
                self.num_heads, self.mlp_ratio, self.attention_impl, name=f"video_dit_block_{i}", **kw
            )(tokens, c)

        out_channels = 2 * channels if self.learn_sigma else channels
        tokens = tokens.reshape(batch, -1, self.emb_features)
        patch_values = patch[0] * patch[1] * patch[2] * out_channels
        out = FinalLayer(patch_values, name="final_layer", **kw)(tokens, c)
        return unpatchify(out, grid, patch, out_channels).astype(x.dtype)
