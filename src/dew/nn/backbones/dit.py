"""SimpleDiT: a diffusion transformer over image patches (Peebles & Xie 2023, "Scalable Diffusion
Models with Transformers").

    x [B, H, W, C] -> patch_embed (p x p conv) + fixed 2-D sin/cos positions -> tokens [B, N, D]
    c = noise_embed(noise_input) + label_embed(label) + condition_embed(embedding)      [B, D]
    num_layers x dit_block_i (adaLN-zero: modulated attention and MLP, gates from c)
    final_layer (adaLN shift/scale, zero-initialized linear to p*p*C) -> unpatchify -> [B, H, W, C]

With ``text_features`` the model also reads text tokens "text" [B, T, text_features] (and
"text_mask" [B, T]), as PixArt-alpha does: every block cross-attends to the valid tokens after its
self-attention, and the mean of the valid tokens (`PooledTextEmbedding`) is added to c.

The modulations, the final linear, the cross-attention's output and the pooled text's last layer
start at zero, so a fresh model outputs exactly 0 (DiT's adaLN-Zero) and a text-conditioned one
starts as the unconditioned one does. Call convention (`dew.diffusion.process`):
``model.apply(variables, x, noise_input, conditions)``; conditions follow `dew.nn.embeddings`
("label", "embedding", "text", "text_mask"; a missing key or a null row means unconditional).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.checks import count
from dew.nn.attention import check_attention_impl
from dew.nn.embeddings import (
    ConditionVector,
    PatchEmbedding,
    PooledTextEmbedding,
    check_channels,
    check_conditions,
    check_patch_grid,
    pooled_condition_keys,
    sincos_positions,
    text_condition_keys,
    text_tokens,
    unpatchify,
)
from dew.nn.vit import AdaLNZeroBlock, FinalLayer


def check_image(x: Any, rank: int, model: str, layout: str) -> None:
    """A ValueError unless ``x`` has ``rank`` axes (``layout`` names them)."""
    if len(x.shape) != rank:
        raise ValueError(f"{model} expects input {layout}; got shape {tuple(x.shape)}")


class SimpleDiT(nn.Module):
    """DiT over [B, H, W, C] images (or latents). H and W must be multiples of ``patch_size``.

    ``learn_sigma`` doubles the output channels (DiT's learned variance), so the output is
    [B, H, W, 2C] instead of the input's shape. ``noise_scale`` multiplies noise_input before
    its sinusoidal features (see `NoiseEmbedding`). ``text_features`` (None: no text) is the width
    of the "text" condition's tokens (see the module doc).
    """

    patch_size: int
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
    text_features: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array, noise_input: jax.Array,
                 conditions: Mapping[str, Any] | None = None) -> jax.Array:
        name = type(self).__name__
        check_attention_impl(self.attention_impl)
        check_image(x, 4, name, "[batch, height, width, channels]")
        accepted = pooled_condition_keys(self.num_classes, self.condition_features)
        if count(self.text_features, f"{name}.text_features", optional=True) is not None:
            accepted.update(text_condition_keys(self.text_features))
        conditions = check_conditions(conditions, accepted, name)
        batch, height, width, channels = x.shape
        p = self.patch_size
        grid = check_patch_grid((height, width), (p, p), ("height", "width"), name)
        check_channels(self, channels, ("patch_embed", "proj", "kernel"), -2, name)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)

        c = ConditionVector(
            self.emb_features, self.num_classes, self.condition_features, self.noise_scale,
            model=name, name="conditioning", **kw,
        )(noise_input, conditions, batch)
        text = valid = None
        if self.text_features is not None:
            text, valid = text_tokens(conditions, batch, self.text_features, self.dtype, name)
            c = c + PooledTextEmbedding(self.emb_features, name="pooled_text_embed", **kw)(text, valid)

        tokens = PatchEmbedding(self.emb_features, (p, p), name="patch_embed", **kw)(x.astype(self.dtype))
        tokens = tokens.reshape(batch, grid[0] * grid[1], self.emb_features)
        tokens = tokens + jnp.asarray(sincos_positions(self.emb_features, grid), self.dtype)[None]

        for i in range(self.num_layers):
            tokens = AdaLNZeroBlock(
                self.num_heads, self.mlp_ratio, self.attention_impl, name=f"dit_block_{i}", **kw
            )(tokens, c, None, text, valid)

        out_channels = 2 * channels if self.learn_sigma else channels
        out = FinalLayer(p * p * out_channels, name="final_layer", **kw)(tokens, c)
        return unpatchify(out, grid, (p, p), out_channels).astype(x.dtype)
