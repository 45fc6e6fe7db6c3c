"""Stable Diffusion 3's MMDiT with diffusers' SD3Transformer2DModel structure, so weights map one to one.

Esser et al. 2024, "Scaling Rectified Flow Transformers for High-Resolution Image Synthesis". The
parameter tree mirrors diffusers' module names (``transformer_blocks_0/attn/to_q`` is
``transformer_blocks.0.attn.to_q``), which is why this is a module of its own beside Dew's
`MMDiT` (same idea, Dew's own layout):

    x [B, H, W, C] -> pos_embed: 2x2 patches + the centre crop of a fixed sin/cos table
                      (pos_embed_max_size^2 positions)                              -> [B, N, D]
    encoder_hidden_states [B, L, joint_attention_dim] -> context_embedder           -> [B, L, D]
    c = timestep_embedder(sinusoid(timesteps)) + text_embedder(pooled_projections)  [B, D]
    num_layers x transformer_blocks_i (JointBlock): adaLN-zero per stream from c, one attention
        over [image; text]; blocks in ``dual_attention_layers`` add an image-only attention
        (SD3.5-medium); the last block's text stream stops after giving keys and values
    norm_out (adaLN: scale, shift from c) -> proj_out -> unpatchify -> [B, H, W, out_channels]

``timesteps`` are what the SD3 pipeline passes: sigma * 1000 as float. The output is the flow
velocity the diffusers model returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.checks import count
from dew.nn.attention import check_attention_impl
from dew.nn.backbones.decoder_parts import RMSNorm
from dew.nn.backbones.dit import check_image
from dew.nn.embeddings import (
    PatchEmbedding,
    check_conditions,
    check_patch_grid,
    dense,
    sinusoidal_features,
    unpatchify,
)
from dew.nn.vit import attend, gated, layer_norm, modulate

QK_NORMS = (None, "rms_norm")  # the qk_norm values Dew implements (SD3: None, SD3.5: "rms_norm")
TIMESTEP_FEATURES = 256  # the sinusoid width of diffusers' Timesteps(256, flip_sin_to_cos=True)


def _axis_features(indices: np.ndarray, features: int, max_size: int, base_size: int) -> np.ndarray:
    """[n, features // 2]: sin then cos of ``position / 10000^(i / (features / 4))`` for table rows ``indices``.

    Positions are ``index * base_size / max_size`` in float32, as diffusers computes them, so the
    trained resolution (base_size = sample_size // patch_size patches) spans ``base_size`` units.
    """
    positions = indices.astype(np.float32) / np.float32(max_size / base_size)
    omega = 1.0 / 10000 ** (np.arange(features // 4, dtype=np.float64) / (features / 4))
    angles = np.outer(positions.astype(np.float64), omega)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)


def grid_positions(features: int, max_size: int, base_size: int, top: int, left: int,
                    height: int, width: int) -> np.ndarray:
    """Rows top.. and columns left.. of the table, row-major [height * width, features] float32."""
    if features % 4:
        raise ValueError(
            f"SD3Transformer: the inner width {features} must be a multiple of 4 for the 2-D sin/cos "
            "table (two axes, sin and cos each); choose num_attention_heads * attention_head_dim to fit"
        )
    rows = _axis_features(np.arange(top, top + height), features, max_size, base_size).astype(np.float32)
    cols = _axis_features(np.arange(left, left + width), features, max_size, base_size).astype(np.float32)
    half = features // 2
    table = np.concatenate([np.broadcast_to(cols[None, :, :], (height, width, half)),
                            np.broadcast_to(rows[:, None, :], (height, width, half))], axis=-1)
    return table.reshape(height * width, features)


def position_table(features: int, max_size: int, base_size: int) -> np.ndarray:
    """The [max_size^2, features] sin/cos table diffusers' PatchEmbed holds (get_2d_sincos_pos_embed).

    The first half of the features encodes the column, the second half the row.
    """
    return grid_positions(features, max_size, base_size, 0, 0, max_size, max_size)


def cropped_positions(features: int, max_size: int, base_size: int, grid: tuple[int, int]) -> np.ndarray:
    """The centre ``grid`` crop of `position_table`, row-major [grid_h * grid_w, features] (SD3's cropping)."""
    height, width = grid
    if height > max_size or width > max_size:
        raise ValueError(
            f"SD3Transformer: the latent is {height} x {width} patches, but pos_embed_max_size={max_size} "
            f"covers at most {max_size} x {max_size}; use a latent of at most {max_size} patches a side"
        )
    top, left = (max_size - height) // 2, (max_size - width) // 2
    return grid_positions(features, max_size, base_size, top, left, height, width)


class TwoLayerEmbedding(nn.Module):
    """x -> linear_1 -> SiLU -> linear_2: diffusers' TimestepEmbedding and PixArtAlphaTextProjection."""

    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h = dense(self.features, (None, "embed"), "linear_1", **kw)(x)
        return dense(self.features, ("embed", "mlp"), "linear_2", **kw)(nn.silu(h))


class TimeTextEmbedding(nn.Module):
    """c [B, D] = timestep_embedder(sinusoid(timesteps)) + text_embedder(pooled): CombinedTimestepTextProjEmbeddings.

    The sinusoid is diffusers' Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0): cos then
    sin of ``timesteps * 10000^(-i / 128)``, on the raw timesteps (sigma * 1000, no further scaling).
    """

    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, timesteps: jax.Array, pooled: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        frequencies = sinusoidal_features(timesteps, TIMESTEP_FEATURES).astype(self.dtype)
        return (TwoLayerEmbedding(self.features, name="timestep_embedder", **kw)(frequencies)
                + TwoLayerEmbedding(self.features, name="text_embedder", **kw)(pooled))


class AdaNorm(nn.Module):
    """c [B, D] -> ``chunks`` vectors [B, features] through ``linear(silu(c))``: diffusers' AdaLayerNorm*."""

    chunks: int
    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, c: jax.Array) -> list[jax.Array]:
        out = dense(self.chunks * self.features, ("embed", "mlp"), "linear",
                    dtype=self.dtype, param_dtype=self.param_dtype)(nn.silu(c))
        return jnp.split(out, self.chunks, axis=-1)


class FeedForward(nn.Module):
    """Dense(4D) -> tanh-GELU -> Dense(D), named as diffusers' FeedForward (net.0.proj, net.2)."""

    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        features = x.shape[-1]
        h = nn.gelu(dense(4 * features, ("embed", "mlp"), "net_0_proj", **kw)(x), approximate=True)
        return dense(features, ("mlp", "embed"), "net_2", **kw)(h)


class Attention(nn.Module):
    """diffusers' Attention with JointAttnProcessor: image q/k/v, optionally text (``add_*``) q/k/v.

    Both streams attend once over [image; text]; ``qk_norm="rms_norm"`` normalizes each head's
    queries and keys (per stream) first. Returns (image output, text output or None). The text
    output projection ``to_add_out`` exists unless ``context_pre_only``.
    """

    num_heads: int
    head_dim: int
    qk_norm: str | None = None
    joint: bool = True
    context_pre_only: bool = False
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def _heads(self, tokens, names, norm_names):
        """tokens [B, L, D] -> q, k, v [B, L, heads, head_dim] through the Dense layers ``names``."""
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        width, split = self.num_heads * self.head_dim, (*tokens.shape[:2], self.num_heads, self.head_dim)
        q, k, v = (dense(width, ("embed", "heads"), name, **kw)(tokens).reshape(split) for name in names)
        if self.qk_norm == "rms_norm":
            q = RMSNorm(1e-6, name=norm_names[0], **kw)(q)
            k = RMSNorm(1e-6, name=norm_names[1], **kw)(k)
        return q, k, v

    @nn.compact
    def __call__(self, x: jax.Array, ctx: jax.Array | None = None):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        features = x.shape[-1]
        q, k, v = self._heads(x, ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"))
        if self.joint:
            tq, tk, tv = self._heads(ctx, ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k"))
            q, k, v = (jnp.concatenate(pair, axis=1) for pair in ((q, tq), (k, tk), (v, tv)))
        out = attend(q, k, v, impl=self.attention_impl)
        image, text = out[:, : x.shape[1]], out[:, x.shape[1]:]
        image = dense(features, ("heads", "embed"), "to_out_0", **kw)(image)
        if not self.joint or self.context_pre_only:
            return image, None
        return image, dense(features, ("heads", "embed"), "to_add_out", **kw)(text)


class JointBlock(nn.Module):
    """diffusers' JointTransformerBlock over image tokens x [B, N, D] and text tokens ctx [B, L, D].

    ``norm1`` gives (shift, scale, gate) for attention and for the MLP, plus a third set for
    ``attn2`` when ``dual_attention`` (SD35AdaLayerNormZeroX); ``norm1_context`` is adaLN-zero,
    or with ``context_pre_only`` (the last block) a plain adaLN (scale, shift) whose text stream
    ends after attention, so the block returns ctx None.
    """

    num_heads: int
    head_dim: int
    context_pre_only: bool = False
    qk_norm: str | None = None
    dual_attention: bool = False
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, ctx, c):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        features = x.shape[-1]
        attention = dict(num_heads=self.num_heads, head_dim=self.head_dim, qk_norm=self.qk_norm,
                         attention_impl=self.attention_impl, **kw)
        image_mod = AdaNorm(9 if self.dual_attention else 6, features, name="norm1", **kw)(c)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = image_mod[:6]
        normed = layer_norm(**kw)(x)
        if self.context_pre_only:
            c_scale, c_shift = AdaNorm(2, features, name="norm1_context", **kw)(c)
        else:
            c_shift, c_scale, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = AdaNorm(
                6, features, name="norm1_context", **kw)(c)
        normed_ctx = modulate(layer_norm(**kw)(ctx), c_shift, c_scale)

        image_out, text_out = Attention(context_pre_only=self.context_pre_only, name="attn", **attention)(
            modulate(normed, shift_msa, scale_msa), normed_ctx)
        x = gated(x, gate_msa, image_out)
        if self.dual_attention:
            shift_msa2, scale_msa2, gate_msa2 = image_mod[6:]
            image_out2, _ = Attention(joint=False, name="attn2", **attention)(modulate(normed, shift_msa2, scale_msa2))
            x = gated(x, gate_msa2, image_out2)
        x = gated(x, gate_mlp, FeedForward(name="ff", **kw)(modulate(layer_norm(**kw)(x), shift_mlp, scale_mlp)))
        if self.context_pre_only:
            return x, None

        ctx = gated(ctx, c_gate_msa, text_out)
        h = modulate(layer_norm(**kw)(ctx), c_shift_mlp, c_scale_mlp)
        ctx = gated(ctx, c_gate_mlp, FeedForward(name="ff_context", **kw)(h))
        return x, ctx


class SD3Transformer(nn.Module):
    """SD3 / SD3.5's denoiser: latents [B, H, W, in_channels] -> velocity [B, H, W, out_channels].

    Fields carry diffusers' config names. Conditions: ``"encoder_hidden_states"`` [B, L,
    joint_attention_dim] (CLIP-L/G and T5 token embeddings) and ``"pooled_projections"`` [B,
    pooled_projection_dim] (the pooled CLIP embeddings), both required.
    """

    sample_size: int = 128
    patch_size: int = 2
    in_channels: int = 16
    num_layers: int = 18
    attention_head_dim: int = 64
    num_attention_heads: int = 18
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 2048
    out_channels: int = 16
    pos_embed_max_size: int = 96
    dual_attention_layers: tuple[int, ...] = ()
    qk_norm: str | None = None
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    def check_settings(self) -> None:
        """Raise for settings this structure cannot be built with, naming the setting."""
        for size in ("sample_size", "patch_size", "in_channels", "num_layers", "attention_head_dim",
                     "num_attention_heads", "joint_attention_dim", "pooled_projection_dim", "out_channels",
                     "pos_embed_max_size"):
            count(getattr(self, size), f"SD3Transformer.{size}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"SD3Transformer: qk_norm={self.qk_norm!r} is not implemented; Dew builds "
                             f"qk_norm in {list(QK_NORMS)} (SD3: None, SD3.5: 'rms_norm')")
        outside = [i for i in self.dual_attention_layers if not 0 <= i < self.num_layers]
        if outside:
            raise ValueError(f"SD3Transformer: dual_attention_layers {list(outside)} are not block indices "
                             f"of a {self.num_layers}-layer model; list indices in [0, {self.num_layers})")
        base = self.sample_size // self.patch_size
        if base < 1:
            raise ValueError(f"SD3Transformer: sample_size={self.sample_size} is smaller than "
                             f"patch_size={self.patch_size}; sample_size is the latent side trained at")

    def _conditions(self, conditions, batch):
        name = type(self).__name__
        accepted = {
            "encoder_hidden_states": f"float [batch, tokens, {self.joint_attention_dim}] text token embeddings",
            "pooled_projections": f"float [batch, {self.pooled_projection_dim}] pooled text embeddings",
        }
        conditions = check_conditions(conditions, accepted, name)
        shapes = {"encoder_hidden_states": (batch, None, self.joint_attention_dim),
                  "pooled_projections": (batch, self.pooled_projection_dim)}
        values = []
        for key, shape in shapes.items():
            if conditions.get(key) is None:
                raise ValueError(f"{name} needs condition {key!r} ({accepted[key]}); for the unconditional "
                                 "branch pass the empty prompt's embeddings, as the SD3 pipeline does")
            value = jnp.asarray(conditions[key])
            if value.ndim != len(shape) or any(want not in (None, got) for want, got in zip(shape, value.shape)):
                want = ", ".join("tokens" if d is None else str(d) for d in shape)
                raise ValueError(f"{name}: condition {key!r} must be [{want}]; got {tuple(value.shape)}")
            values.append(value.astype(self.dtype))
        return values

    @nn.compact
    def __call__(self, x: jax.Array, timesteps: jax.Array,
                 conditions: Mapping[str, Any] | None = None) -> jax.Array:
        name = type(self).__name__
        check_attention_impl(self.attention_impl)
        self.check_settings()
        check_image(x, 4, name, f"[batch, height, width, {self.in_channels}]")
        batch, height, width, channels = x.shape
        if channels != self.in_channels:
            raise ValueError(f"{name}: latents have {channels} channels, but in_channels={self.in_channels}; "
                             f"pass [batch, height, width, {self.in_channels}] latents")
        timesteps = jnp.asarray(timesteps, jnp.float32)
        if timesteps.shape != (batch,):
            raise ValueError(f"{name}: timesteps must be [{batch}] (sigma * 1000 per example); got {timesteps.shape}")
        text, pooled = self._conditions(conditions, batch)
        p, features = self.patch_size, self.inner_dim
        grid = check_patch_grid((height, width), (p, p), ("height", "width"), name)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)

        tokens = PatchEmbedding(features, (p, p), name="pos_embed", **kw)(x.astype(self.dtype))
        tokens = tokens.reshape(batch, grid[0] * grid[1], features)
        positions = cropped_positions(features, self.pos_embed_max_size, self.sample_size // p, grid)
        tokens = tokens + jnp.asarray(positions, self.dtype)[None]

        c = TimeTextEmbedding(features, name="time_text_embed", **kw)(timesteps, pooled)
        ctx = dense(features, (None, "embed"), "context_embedder", **kw)(text)

        for i in range(self.num_layers):
            tokens, ctx = JointBlock(
                self.num_attention_heads, self.attention_head_dim, context_pre_only=i == self.num_layers - 1,
                qk_norm=self.qk_norm, dual_attention=i in self.dual_attention_layers,
                attention_impl=self.attention_impl, name=f"transformer_blocks_{i}", **kw,
            )(tokens, ctx, c)

        scale, shift = AdaNorm(2, features, name="norm_out", **kw)(c)
        tokens = modulate(layer_norm(**kw)(tokens), shift, scale)
        out = dense(p * p * self.out_channels, ("embed", None), "proj_out", **kw)(tokens)
        return unpatchify(out, grid, (p, p), self.out_channels).astype(x.dtype)
