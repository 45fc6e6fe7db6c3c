"""UNet: the convolutional diffusion backbone of DDPM / ADM (Ho et al. 2020; Dhariwal & Nichol 2021,
openai/guided-diffusion ``unet.py``).

    conv_in (3x3, ``channels``)
    down: for each level l (width channels * channel_mults[l]):
        num_res_blocks x [ResBlock (+ self-attention when the map's side is in attention_resolutions)]
        then a stride-2 conv (all levels but the last); every output is kept as a skip
    mid: ResBlock, self-attention, ResBlock
    up: levels in reverse, num_res_blocks + 1 x [concat a skip, ResBlock (+ attention)],
        then nearest 2x upsampling + 3x3 conv (all levels but the first)
    GroupNorm -> SiLU -> conv_out (3x3, zero-initialized, back to the input's channels)

A ResBlock is GroupNorm -> SiLU -> conv, then GroupNorm(h) * (1 + scale) + shift with (scale, shift)
from the conditioning vector c (noise + label + pooled embedding, width 4 * channels), SiLU,
dropout and a zero-initialized conv, added to the (1x1-projected) input. A fresh UNet outputs
exactly 0, and every ResBlock and attention starts as the identity.

With ``text_features`` the UNet also reads text tokens "text" [B, T, text_features] (and
"text_mask" [B, T]), as Stable Diffusion's UNet does: every attention block (those at the
attention resolutions and the middle one) cross-attends to the valid tokens after its
self-attention, and the mean of the valid tokens (`PooledTextEmbedding`) joins c. Both start at
zero, so a fresh text-conditioned UNet starts as the unconditioned one does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.checks import count
from dew.nn.attention import check_attention_impl
from dew.nn.embeddings import (
    ConditionVector,
    PooledTextEmbedding,
    check_channels,
    check_conditions,
    dense,
    pooled_condition_keys,
    text_condition_keys,
    text_tokens,
)
from dew.nn.norms import GroupNorm
from dew.nn.vae import CONV_INIT, PointwiseConv, UpsampleConv
from dew.nn.vit import CrossAttention, SelfAttention, layer_norm


def conv(features, name, *, kernel=3, stride=1, zero=False, dtype, param_dtype):
    """A 'same'-padded conv with a logically named kernel [k, k, in, out] (1x1: a `PointwiseConv`)."""
    # PyTorch's default conv init, as ADM: uniform with variance 1 / (3 fan_in)
    init = nn.initializers.zeros if zero else CONV_INIT
    kernel_init = nn.with_logical_partitioning(init, (None, None, None, "embed"))
    if kernel == 1 and stride == 1:
        return PointwiseConv(features, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, name=name)
    return nn.Conv(
        features,
        kernel_size=(kernel, kernel),
        strides=(stride, stride),
        padding=((kernel // 2, kernel // 2), (kernel // 2, kernel // 2)),
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=kernel_init,
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
        name=name,
    )


class ResBlock(nn.Module):
    """Residual block with scale/shift noise conditioning (ADM's ``use_scale_shift_norm``)."""

    features: int
    num_groups: int = 8
    dropout: float = 0.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, c: jax.Array, train: bool = False) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h = nn.silu(GroupNorm(self.num_groups, name="norm1", **kw)(x))
        h = conv(self.features, "conv1", **kw)(h)
        modulation = dense(2 * self.features, ("embed", "mlp"), "modulation", **kw)(nn.silu(c))
        scale, shift = jnp.split(modulation, 2, axis=-1)
        h = GroupNorm(self.num_groups, name="norm2", **kw)(h) * (1 + scale[:, None, None]) + shift[:, None, None]
        h = nn.Dropout(self.dropout, deterministic=not train)(nn.silu(h))
        h = conv(self.features, "conv2", zero=True, **kw)(h)
        if x.shape[-1] != self.features:
            x = conv(self.features, "skip", kernel=1, **kw)(x)
        return x + h


class AttentionBlock(nn.Module):
    """GroupNorm then multi-head self-attention over the H*W positions, added residually; given
    ``text`` [B, T, E] and ``text_valid`` [B, T], then LayerNorm and cross-attention to the text."""

    num_heads: int
    num_groups: int = 8
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, text: jax.Array | None = None,
                 text_valid: jax.Array | None = None) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        batch, height, width, features = x.shape
        h = GroupNorm(self.num_groups, name="norm", **kw)(x).reshape(batch, height * width, features)
        h = SelfAttention(self.num_heads, self.attention_impl, zero_out=True, name="attn", **kw)(h)
        x = x + h.reshape(x.shape)
        if text is None:
            return x
        h = layer_norm("norm_cross", affine=True, **kw)(x.reshape(batch, height * width, features))
        h = CrossAttention(self.num_heads, self.attention_impl, name="cross_attn", **kw)(h, text, text_valid)
        return x + h.reshape(x.shape)


class UNet(nn.Module):
    """A noise-conditioned UNet over [B, H, W, C]; the output has the input's shape.

    ``attention_resolutions`` holds feature-map sides (heights, in pixels of that map): a level
    whose map is 16x16 attends when 16 is in the set, as in ADM. With 32x32 inputs and
    channel_mults (1, 2, 2) the levels run at 32, 16 and 8; the middle block always attends.
    H and W must be multiples of 2^(len(channel_mults) - 1), and every level's width a multiple
    of ``num_groups`` and ``num_heads``. ``dropout`` applies when called with ``train=True``
    (pass a "dropout" rng). ``text_features`` (None: no text) is the width of the "text"
    condition's tokens (see the module doc).
    """

    channels: int = 64
    channel_mults: Sequence[int] = (1, 2, 2)
    num_res_blocks: int = 2
    attention_resolutions: Sequence[int] = (16,)
    dropout: float = 0.0
    num_classes: int | None = None
    condition_features: int | None = None
    num_groups: int = 8
    num_heads: int = 4
    noise_scale: float = 1000.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    attention_impl: str = "auto"
    text_features: int | None = None

    def _check(self, x) -> None:
        name = type(self).__name__
        if len(x.shape) != 4:
            raise ValueError(f"{name} expects input [batch, height, width, channels]; got shape {tuple(x.shape)}")
        factor = 2 ** (len(self.channel_mults) - 1)
        for side, label in zip(x.shape[1:3], ("height", "width")):
            if side % factor:
                raise ValueError(
                    f"{name}: input {label} {side} is not divisible by {factor}, which "
                    f"{len(self.channel_mults)} levels (channel_mults={tuple(self.channel_mults)}) "
                    f"halve {len(self.channel_mults) - 1} times; resize the input or use fewer levels"
                )
        for mult in self.channel_mults:
            width = self.channels * mult
            if width % self.num_groups or width % self.num_heads:
                raise ValueError(
                    f"{name}: level width {width} (channels={self.channels} x {mult}) must be a "
                    f"multiple of num_groups={self.num_groups} and num_heads={self.num_heads}"
                )

    @nn.compact
    def __call__(self, x: jax.Array, noise_input: jax.Array,
                 conditions: Mapping[str, Any] | None = None, train: bool = False) -> jax.Array:
        name = type(self).__name__
        check_attention_impl(self.attention_impl)
        self._check(x)
        accepted = pooled_condition_keys(self.num_classes, self.condition_features)
        if count(self.text_features, f"{name}.text_features", optional=True) is not None:
            accepted.update(text_condition_keys(self.text_features))
        conditions = check_conditions(conditions, accepted, name)
        batch, _, _, in_channels = x.shape
        check_channels(self, in_channels, ("conv_in", "kernel"), -2, name)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        block = dict(num_groups=self.num_groups, dropout=self.dropout, **kw)
        attn = dict(num_heads=self.num_heads, num_groups=self.num_groups, attention_impl=self.attention_impl, **kw)
        attention = set(int(r) for r in self.attention_resolutions)

        c = ConditionVector(
            4 * self.channels, self.num_classes, self.condition_features, self.noise_scale,
            model=name, name="conditioning", **kw,
        )(noise_input, conditions, batch)
        text = ()  # the attention blocks' text arguments: none, or (tokens, valid)
        if self.text_features is not None:
            text = text_tokens(conditions, batch, self.text_features, self.dtype, name)
            c = c + PooledTextEmbedding(4 * self.channels, name="pooled_text_embed", **kw)(*text)

        h = conv(self.channels, "conv_in", **kw)(x.astype(self.dtype))
        skips = [h]
        last = len(self.channel_mults) - 1
        for level, mult in enumerate(self.channel_mults):
            for i in range(self.num_res_blocks):
                h = ResBlock(self.channels * mult, name=f"down_{level}_res_{i}", **block)(h, c, train)
                if h.shape[1] in attention:
                    h = AttentionBlock(name=f"down_{level}_attn_{i}", **attn)(h, *text)
                skips.append(h)
            if level != last:
                h = conv(h.shape[-1], f"down_{level}_downsample", stride=2, **kw)(h)
                skips.append(h)

        h = ResBlock(h.shape[-1], name="mid_res_0", **block)(h, c, train)
        h = AttentionBlock(name="mid_attn", **attn)(h, *text)
        h = ResBlock(h.shape[-1], name="mid_res_1", **block)(h, c, train)

        for level in reversed(range(len(self.channel_mults))):
            for i in range(self.num_res_blocks + 1):
                h = jnp.concatenate([h, skips.pop()], axis=-1)
                width = self.channels * self.channel_mults[level]
                h = ResBlock(width, name=f"up_{level}_res_{i}", **block)(h, c, train)
                if h.shape[1] in attention:
                    h = AttentionBlock(name=f"up_{level}_attn_{i}", **attn)(h, *text)
            if level != 0:
                h = UpsampleConv(h.shape[-1], name=f"up_{level}_upsample", **kw)(h)

        h = nn.silu(GroupNorm(self.num_groups, name="norm_out", **kw)(h))
        return conv(in_channels, "conv_out", zero=True, **kw)(h).astype(x.dtype)
