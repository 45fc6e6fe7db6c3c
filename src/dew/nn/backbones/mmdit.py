"""MMDiT: a text-to-image diffusion transformer with joint attention (Esser et al. 2024, "Scaling
Rectified Flow Transformers for High-Resolution Image Synthesis", the SD3 architecture).

Two token streams keep their own weights and meet only in attention:

    image: x [B, H, W, C] -> patch_embed + 2-D sin/cos positions       -> [B, N, D]
    text:  conditions["text"] [B, T, text_features] -> text_embed     -> [B, T, D]
    c = noise_embed(noise_input) + pooled_text_embed(mean of the text tokens)
        (+ label / pooled "embedding" when built with num_classes / condition_features)
    num_layers x mmdit_block_i:
        each stream: adaLN-zero modulation from c, its own LN, QKV, output projection and MLP;
        attention runs once over the concatenation [image; text] so each stream reads the other
    final_layer on the image stream -> unpatchify -> [B, H, W, C]

Text tokens whose embedding is all zeros are padding: no query attends to them and the pooled
mean skips them. So a row that condition dropout zeroed, and a missing "text" key, both give the
image-only (unconditional) output. An optional boolean "text_mask" [B, T] marks further padding.
As in SD3 the last block's text stream stops after producing keys and values.
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
    dense,
    masked_mean,
    pooled_condition_keys,
    sincos_positions,
    text_condition_keys,
    text_tokens,
    unpatchify,
)
from dew.nn.vit import QKV, FinalLayer, MlpBlock, Modulation, attend, gated, layer_norm, modulate


class JointBlock(nn.Module):
    """One MMDiT block over image tokens x [B, N, D] and text tokens ctx [B, T, D].

    ``text_valid`` [B, T] marks the text tokens attention may read. ``last`` drops the text
    stream's attention output and MLP (its result would be unused).
    """

    num_heads: int
    mlp_ratio: float = 4.0
    last: bool = False
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, ctx, c, text_valid):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        features = x.shape[-1]
        x_mod = Modulation(6, features, name="image_modulation", **kw)(c)
        t_mod = Modulation(2 if self.last else 6, features, name="text_modulation", **kw)(c)

        xq, xk, xv = QKV(self.num_heads, name="image_qkv", **kw)(
            modulate(layer_norm("image_norm1", **kw)(x), x_mod[0], x_mod[1]))
        tq, tk, tv = QKV(self.num_heads, name="text_qkv", **kw)(
            modulate(layer_norm("text_norm1", **kw)(ctx), t_mod[0], t_mod[1]))
        q, k, v = (jnp.concatenate(pair, axis=1) for pair in ((xq, tq), (xk, tk), (xv, tv)))
        keys = jnp.concatenate([jnp.ones(x.shape[:2], bool), text_valid], axis=1)
        out = attend(q, k, v, mask=keys[:, None, None, :], impl=self.attention_impl)
        x_out, t_out = out[:, : x.shape[1]], out[:, x.shape[1]:]

        x = gated(x, x_mod[2], dense(features, ("heads", "embed"), "image_out", **kw)(x_out))
        h = modulate(layer_norm("image_norm2", **kw)(x), x_mod[3], x_mod[4])
        x = gated(x, x_mod[5], MlpBlock(self.mlp_ratio, name="image_mlp", **kw)(h))
        if self.last:
            return x, ctx
        ctx = gated(ctx, t_mod[2], dense(features, ("heads", "embed"), "text_out", **kw)(t_out))
        h = modulate(layer_norm("text_norm2", **kw)(ctx), t_mod[3], t_mod[4])
        ctx = gated(ctx, t_mod[5], MlpBlock(self.mlp_ratio, name="text_mlp", **kw)(h))
        return x, ctx


class MMDiT(nn.Module):
    """SD3-style joint-attention DiT over [B, H, W, C], conditioned on "text" [B, T, text_features].

    Output has the input's shape ([B, H, W, 2C] with ``learn_sigma``). Accepted conditions:
    "text", "text_mask", plus "label" / "embedding" when num_classes / condition_features are set.
    """

    patch_size: int
    emb_features: int
    num_layers: int
    num_heads: int
    text_features: int
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
        check_image(x, 4, name, "[batch, height, width, channels]")
        accepted = {**text_condition_keys(self.text_features),
                    **pooled_condition_keys(self.num_classes, self.condition_features)}
        conditions = check_conditions(conditions, accepted, name)
        batch, height, width, channels = x.shape
        p = self.patch_size
        grid = check_patch_grid((height, width), (p, p), ("height", "width"), name)
        check_channels(self, channels, ("patch_embed", "proj", "kernel"), -2, name)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)

        text, valid = text_tokens(conditions, batch, self.text_features, self.dtype, name)
        text = text.astype(self.dtype)
        ctx = dense(self.emb_features, (None, "embed"), "text_embed", **kw)(text)
        pooled = masked_mean(text, valid)
        pooled = dense(self.emb_features, (None, "embed"), "pooled_text_embed_0", **kw)(pooled)
        pooled = dense(self.emb_features, ("embed", "mlp"), "pooled_text_embed_1", **kw)(nn.silu(pooled))

        c = ConditionVector(
            self.emb_features, self.num_classes, self.condition_features, self.noise_scale,
            model=name, name="conditioning", **kw,
        )(noise_input, conditions, batch) + pooled

        tokens = PatchEmbedding(self.emb_features, (p, p), name="patch_embed", **kw)(x.astype(self.dtype))
        tokens = tokens.reshape(batch, grid[0] * grid[1], self.emb_features)
        tokens = tokens + jnp.asarray(sincos_positions(self.emb_features, grid), self.dtype)[None]

        for i in range(self.num_layers):
            tokens, ctx = JointBlock(
                self.num_heads, self.mlp_ratio, last=i == self.num_layers - 1,
                attention_impl=self.attention_impl, name=f"mmdit_block_{i}", **kw,
            )(tokens, ctx, c, valid)

        out_channels = 2 * channels if self.learn_sigma else channels
        out = FinalLayer(p * p * out_channels, name="final_layer", **kw)(tokens, c)
        return unpatchify(out, grid, (p, p), out_channels).astype(x.dtype)
