"""FLUX.1's transformer (Black Forest Labs 2024), diffusers' FluxTransformer2DModel, over plain latents.

FluxPipeline packs latents into 2x2 patches before its transformer and unpacks the output; Dew's
module does both inside, so it takes and returns latents [B, H, W, C] like every Dew image model:

    x [B, H, W, C] -> 2x2 patches -> [B, N = H/2 * W/2, 4C] -> x_embedder               -> [B, N, D]
    encoder_hidden_states [B, L, joint_attention_dim] (T5) -> context_embedder          -> [B, L, D]
    temb = timestep_embedder(sinusoid(1000 t)) (+ guidance_embedder(sinusoid(1000 g)))
           + text_embedder(pooled_projections (CLIP pooled))
    rotary angles per token from ids (axis 0, row, column): text ids are zeros, image ids
        (0, row, column) of the packed grid; each axis takes axes_dims_rope[i] of a head's dims
    num_layers x transformer_blocks_i (double stream: each stream its own adaLN-zero, QKV with
        RMS qk-norm, output projection and feed-forward; attention over [text; image] jointly)
    num_single_layers x single_transformer_blocks_i on [text; image] (one stream: attention and
        MLP side by side from one adaLN-zero, one output projection of both)
    norm_out (adaLN with scale before shift) and proj_out on the image tokens -> unpack -> [B, H, W, C']

``timesteps`` [B] is what FluxPipeline passes (sigma, i.e. its scheduler's timestep / 1000); like
diffusers the module multiplies it (and guidance) by 1000 before the sinusoid. Param paths mirror
diffusers' tensor names (``transformer_blocks_0/attn/to_q`` is ``transformer_blocks.0.attn.to_q``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.checks import count
from dew.nn.attention import check_attention_impl
from dew.nn.backbones.decoder_parts import RMSNorm
from dew.nn.backbones.dit import check_image
from dew.nn.embeddings import check_conditions, dense, sinusoidal_features
from dew.nn.vit import attend, gated, layer_norm, modulate

ROPE_THETA = 10000.0  # FluxPosEmbed's theta
FREQUENCY_FEATURES = 256  # the sinusoid width of the timestep and guidance embeddings (cos then sin, as
#                          diffusers' Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0))
TIME_SCALE = 1000.0  # timesteps (t / 1000 from FluxPipeline) and guidance are scaled by this before the sinusoid


# ------------------------------------------------------------------ packing and positions


def pack_latents(x: jax.Array) -> jax.Array:
    """[B, H, W, C] -> [B, H/2 * W/2, 4C]: FluxPipeline's ``_pack_latents`` in channels-last.

    A token's features are ordered (channel, row in patch, column in patch), as diffusers packs
    an NCHW tensor, so the x_embedder weights of a published checkpoint apply unchanged.
    """
    batch, height, width, channels = x.shape
    x = x.reshape(batch, height // 2, 2, width // 2, 2, channels)
    x = x.transpose(0, 1, 3, 5, 2, 4)
    return x.reshape(batch, (height // 2) * (width // 2), channels * 4)


def unpack_latents(tokens: jax.Array, height: int, width: int) -> jax.Array:
    """[B, H/2 * W/2, 4C] -> [B, H, W, C], the inverse of `pack_latents`."""
    batch, _, features = tokens.shape
    channels = features // 4
    x = tokens.reshape(batch, height // 2, width // 2, channels, 2, 2)
    x = x.transpose(0, 1, 4, 2, 5, 3)
    return x.reshape(batch, height, width, channels)


def image_ids(rows: int, columns: int) -> np.ndarray:
    """[rows * columns, 3] position ids of the packed grid: (0, row, column), row-major."""
    ids = np.zeros((rows, columns, 3), np.float64)
    ids[..., 1] = np.arange(rows)[:, None]
    ids[..., 2] = np.arange(columns)[None, :]
    return ids.reshape(rows * columns, 3)


def rotary_tables(ids: np.ndarray, axes_dims: Sequence[int], theta: float = ROPE_THETA) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [S, sum(axes_dims)] (float32) for position ids [S, n_axes] (FluxPosEmbed).

    Axis i rotates its own ``axes_dims[i]`` dims of every head by ``ids[:, i] * theta^(-2j / dim)``,
    each angle repeated for the two dims of a pair. Computed in float64 as diffusers does, then
    rounded once; the ids are fixed by the latent shape, so the tables are constants of the trace.
    """
    cos, sin = [], []
    for axis, dim in enumerate(axes_dims):
        freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        angles = np.repeat(np.outer(ids[:, axis], freqs), 2, axis=1)
        cos.append(np.cos(angles))
        sin.append(np.sin(angles))
    return np.concatenate(cos, -1).astype(np.float32), np.concatenate(sin, -1).astype(np.float32)


def rotate_pairs(x: jax.Array) -> jax.Array:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): each adjacent pair is one complex number."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    return jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [B, S, heads, head_dim]`` by the tables [S, head_dim], in float32 as diffusers."""
    x32 = x.astype(jnp.float32)
    out = x32 * cos[None, :, None, :] + rotate_pairs(x32) * sin[None, :, None, :]
    return out.astype(x.dtype)


# ------------------------------------------------------------------ embeddings


class TwoLayerEmbedding(nn.Module):
    """x -> linear_1 -> SiLU -> linear_2: diffusers' TimestepEmbedding and the pooled text projection."""

    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h = dense(self.features, (None, "embed"), "linear_1", **kw)(x.astype(self.dtype))
        return dense(self.features, ("embed", "mlp"), "linear_2", **kw)(nn.silu(h))


class TimeTextEmbedding(nn.Module):
    """temb [B, D] from the timestep, the guidance (when built with it) and the pooled text.

    CombinedTimestepGuidanceTextProjEmbeddings with ``guidance``, else CombinedTimestepTextProjEmbeddings.
    """

    features: int
    guidance_embeds: bool
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, timesteps: jax.Array, pooled: jax.Array, guidance: jax.Array | None) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        temb = TwoLayerEmbedding(self.features, name="timestep_embedder", **kw)(
            sinusoidal_features(TIME_SCALE * timesteps.astype(jnp.float32), FREQUENCY_FEATURES))
        if self.guidance_embeds:
            temb = temb + TwoLayerEmbedding(self.features, name="guidance_embedder", **kw)(
                sinusoidal_features(TIME_SCALE * guidance.astype(jnp.float32), FREQUENCY_FEATURES))
        return temb + TwoLayerEmbedding(self.features, name="text_embedder", **kw)(pooled)


class AdaModulation(nn.Module):
    """temb [B, D] -> ``chunks`` vectors [B, D]: SiLU -> ``linear`` (diffusers' adaLN projections).

    Zero-initialized, so a fresh block's gates are 0 and it starts as the identity (adaLN-zero).
    """

    chunks: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, temb: jax.Array) -> list[jax.Array]:
        features = temb.shape[-1]
        out = dense(self.chunks * features, ("embed", "mlp"), "linear", zero=True,
                    dtype=self.dtype, param_dtype=self.param_dtype)(nn.silu(temb))
        return jnp.split(out, self.chunks, axis=-1)


class FeedForward(nn.Module):
    """``net_0_proj`` (D -> 4D) -> tanh-GELU -> ``net_2`` (4D -> D): diffusers' FeedForward (net.0.proj, net.2)."""

    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        features = x.shape[-1]
        h = dense(4 * features, ("embed", "mlp"), "net_0_proj", **kw)(x)
        return dense(features, ("mlp", "embed"), "net_2", **kw)(nn.gelu(h, approximate=True))


# ------------------------------------------------------------------ attention


class FluxAttention(nn.Module):
    """diffusers' FluxAttention: per-head RMS-normalized q and k (eps 1e-6), rotary, attention.

    Called with image tokens x [B, N, D] and text tokens ctx [B, L, D] (the double-stream block),
    the text stream has its own projections (add_q_proj / add_k_proj / add_v_proj, norm_added_q /
    norm_added_k); attention runs over [text; image] and each stream gets its output projection
    (to_out_0 / to_add_out). Called with x alone (the single-stream block, diffusers' pre_only),
    it returns the attention's output [B, S, heads * head_dim] without a projection.
    """

    num_heads: int
    head_dim: int
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def _heads(self, x, names):
        """x -> q, k, v [B, S, heads, head_dim] through the projections and norms ``names``."""
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        width = self.num_heads * self.head_dim
        q, k, v = (dense(width, ("embed", "heads"), name, **kw)(x).reshape(*x.shape[:2], self.num_heads, self.head_dim)
                   for name in names[:3])
        return RMSNorm(1e-6, name=names[3], **kw)(q), RMSNorm(1e-6, name=names[4], **kw)(k), v

    @nn.compact
    def __call__(self, x, cos, sin, ctx=None):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        q, k, v = self._heads(x, ("to_q", "to_k", "to_v", "norm_q", "norm_k"))
        if ctx is not None:
            tq, tk, tv = self._heads(ctx, ("add_q_proj", "add_k_proj", "add_v_proj", "norm_added_q", "norm_added_k"))
            q, k, v = (jnp.concatenate(pair, axis=1) for pair in ((tq, q), (tk, k), (tv, v)))
        out = attend(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, impl=self.attention_impl)
        if ctx is None:
            return out
        features = x.shape[-1]
        text_len = ctx.shape[1]
        x_out = dense(features, ("heads", "embed"), "to_out_0", **kw)(out[:, text_len:])
        t_out = dense(features, ("heads", "embed"), "to_add_out", **kw)(out[:, :text_len])
        return x_out, t_out


# ------------------------------------------------------------------ blocks


class FluxTransformerBlock(nn.Module):
    """One double-stream block over image tokens x [B, N, D] and text tokens ctx [B, L, D].

    Each stream has its own adaLN-zero modulation (norm1 / norm1_context: shift, scale, gate for the
    attention, then for the feed-forward), attention projections and feed-forward (ff / ff_context);
    the two meet only in the joint attention.
    """

    num_heads: int
    head_dim: int
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, ctx, temb, cos, sin):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = AdaModulation(6, name="norm1", **kw)(temb)
        c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = AdaModulation(
            6, name="norm1_context", **kw)(temb)
        x_attn, t_attn = FluxAttention(self.num_heads, self.head_dim, self.attention_impl, name="attn", **kw)(
            modulate(layer_norm(**kw)(x), shift, scale), cos, sin,
            ctx=modulate(layer_norm(**kw)(ctx), c_shift, c_scale))

        x = gated(x, gate, x_attn)
        x = gated(x, gate_mlp, FeedForward(name="ff", **kw)(modulate(layer_norm(**kw)(x), shift_mlp, scale_mlp)))
        ctx = gated(ctx, c_gate, t_attn)
        ctx = gated(ctx, c_gate_mlp, FeedForward(name="ff_context", **kw)(
            modulate(layer_norm(**kw)(ctx), c_shift_mlp, c_scale_mlp)))
        return x, ctx


class FluxSingleTransformerBlock(nn.Module):
    """One single-stream block over tokens h [B, S, D] ([text; image]): attention and MLP in parallel.

    One adaLN-zero (``norm``: shift, scale, gate) feeds both branches; ``proj_out`` maps the
    concatenated attention output and tanh-GELU MLP hidden state (``proj_mlp``, 4D wide) back to D.
    """

    num_heads: int
    head_dim: int
    mlp_ratio: float = 4.0
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, h, temb, cos, sin):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        features = h.shape[-1]
        shift, scale, gate = AdaModulation(3, name="norm", **kw)(temb)
        normed = modulate(layer_norm(**kw)(h), shift, scale)
        mlp = nn.gelu(dense(int(features * self.mlp_ratio), ("embed", "mlp"), "proj_mlp", **kw)(normed), approximate=True)
        attn = FluxAttention(self.num_heads, self.head_dim, self.attention_impl, name="attn", **kw)(normed, cos, sin)
        both = jnp.concatenate([attn, mlp], axis=-1)
        return gated(h, gate, dense(features, ("mlp", "embed"), "proj_out", **kw)(both))


# ------------------------------------------------------------------ the model


class FluxTransformer(nn.Module):
    """FLUX.1's transformer over latents [B, H, W, C] (H and W even, ``in_channels == 4 * C``).

    Fields are diffusers' config names (defaults are diffusers'; FLUX.1-dev sets
    ``guidance_embeds=True``). ``__call__(x, timesteps, conditions)``: ``timesteps`` [B] as
    FluxPipeline passes them (t / 1000), ``conditions`` holds "encoder_hidden_states" [B, L,
    joint_attention_dim] (T5), "pooled_projections" [B, pooled_projection_dim] (CLIP pooled) and,
    with ``guidance_embeds``, "guidance" [B] (the guidance scale). Returns [B, H, W, out_channels / 4]:
    the flow velocity the pipeline's scheduler steps with. Initialized in Dew (not loaded), every
    adaLN projection and proj_out start at zero, so a fresh model is blocks of identities and outputs 0.
    """

    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def _check_structure(self, name: str) -> None:
        count(self.in_channels, f"{name}.in_channels")
        count(self.out_channels, f"{name}.out_channels", optional=True)
        count(self.num_layers, f"{name}.num_layers", minimum=0)
        count(self.num_single_layers, f"{name}.num_single_layers", minimum=0)
        count(self.attention_head_dim, f"{name}.attention_head_dim")
        count(self.num_attention_heads, f"{name}.num_attention_heads")
        for field in ("in_channels", "out_channels"):
            value = getattr(self, field)
            if value is not None and value % 4:
                raise ValueError(
                    f"{name}: {field}={value} is not a multiple of 4; FLUX packs each 2x2 patch of C-channel "
                    f"latents into 4C features, so {field} must be 4 * latent channels (64 for 16-channel latents)"
                )
        dims = tuple(self.axes_dims_rope)
        if sum(dims) != self.attention_head_dim or any(d % 2 for d in dims) or len(dims) != 3:
            raise ValueError(
                f"{name}: axes_dims_rope={list(dims)} must be three even sizes summing to attention_head_dim="
                f"{self.attention_head_dim} (one share of each head per ids axis: FLUX.1 uses (16, 56, 56) of 128)"
            )

    def _conditions(self, conditions, batch, name):
        """(encoder_hidden_states [B, L, joint], pooled [B, pooled_dim], guidance [B] or None), checked."""
        accepted = {
            "encoder_hidden_states": f"float [batch, tokens, {self.joint_attention_dim}] T5 token embeddings",
            "pooled_projections": f"float [batch, {self.pooled_projection_dim}] pooled CLIP text embedding",
        }
        if self.guidance_embeds:
            accepted["guidance"] = "float [batch] guidance scale (FLUX.1-dev is distilled to take it)"
        elif conditions is not None and "guidance" in conditions:
            raise ValueError(
                f"{name} was built with guidance_embeds=False (FLUX.1-schnell's structure) and has no guidance "
                "embedding, but conditions hold 'guidance'; leave it out, or load a guidance-distilled "
                "checkpoint (guidance_embeds=True, FLUX.1-dev)"
            )
        conditions = check_conditions(conditions, accepted, name)
        for key, description in accepted.items():
            if conditions.get(key) is None:
                raise ValueError(f"{name} needs condition {key!r}: {description}; the conditions hold {sorted(conditions)}")
        text = jnp.asarray(conditions["encoder_hidden_states"])
        if text.ndim != 3 or text.shape[0] != batch or text.shape[2] != self.joint_attention_dim:
            raise ValueError(
                f"{name}: 'encoder_hidden_states' must be [{batch}, tokens, {self.joint_attention_dim}] "
                f"(joint_attention_dim={self.joint_attention_dim}); got {tuple(text.shape)}"
            )
        pooled = jnp.asarray(conditions["pooled_projections"])
        if pooled.shape != (batch, self.pooled_projection_dim):
            raise ValueError(
                f"{name}: 'pooled_projections' must be [{batch}, {self.pooled_projection_dim}] "
                f"(pooled_projection_dim={self.pooled_projection_dim}); got {tuple(pooled.shape)}"
            )
        guidance = None
        if self.guidance_embeds:
            guidance = jnp.asarray(conditions["guidance"], jnp.float32)
            if guidance.ndim > 1 or (guidance.ndim == 1 and guidance.shape[0] != batch):
                raise ValueError(f"{name}: 'guidance' must be [{batch}] (one scale per example); got {tuple(guidance.shape)}")
            guidance = jnp.broadcast_to(guidance, (batch,))
        return text, pooled, guidance

    @nn.compact
    def __call__(self, x: jax.Array, timesteps: jax.Array, conditions: Mapping[str, Any] | None = None) -> jax.Array:
        name = type(self).__name__
        check_attention_impl(self.attention_impl)
        self._check_structure(name)
        check_image(x, 4, name, "latents [batch, height, width, channels]")
        batch, height, width, channels = x.shape
        if height % 2 or width % 2:
            raise ValueError(
                f"{name}: latents {height}x{width} must have an even height and width (FLUX packs 2x2 "
                "patches); use an image size that is a multiple of 16 pixels"
            )
        if 4 * channels != self.in_channels:
            raise ValueError(
                f"{name}: latents have {channels} channels, but in_channels={self.in_channels} takes "
                f"{self.in_channels // 4} (packed 2x2 into {self.in_channels}); pass "
                f"{self.in_channels // 4}-channel latents or build the model with in_channels={4 * channels}"
            )
        timesteps = jnp.asarray(timesteps, jnp.float32)
        if timesteps.ndim > 1 or (timesteps.ndim == 1 and timesteps.shape[0] != batch):
            raise ValueError(f"{name}: timesteps must be [{batch}] (t / 1000 per example); got {tuple(timesteps.shape)}")
        timesteps = jnp.broadcast_to(timesteps, (batch,))
        text, pooled, guidance = self._conditions(conditions, batch, name)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        inner = self.num_attention_heads * self.attention_head_dim
        heads = dict(num_heads=self.num_attention_heads, head_dim=self.attention_head_dim,
                     attention_impl=self.attention_impl, **kw)

        temb = TimeTextEmbedding(inner, self.guidance_embeds, name="time_text_embed", **kw)(timesteps, pooled, guidance)
        ctx = dense(inner, (None, "embed"), "context_embedder", **kw)(text.astype(self.dtype))
        tokens = dense(inner, (None, "embed"), "x_embedder", **kw)(pack_latents(x).astype(self.dtype))

        rows, columns = height // 2, width // 2
        ids = np.concatenate([np.zeros((text.shape[1], 3)), image_ids(rows, columns)])
        cos, sin = (jnp.asarray(table) for table in rotary_tables(ids, self.axes_dims_rope))

        for i in range(self.num_layers):
            tokens, ctx = FluxTransformerBlock(name=f"transformer_blocks_{i}", **heads)(tokens, ctx, temb, cos, sin)
        joined = jnp.concatenate([ctx, tokens], axis=1)
        for i in range(self.num_single_layers):
            joined = FluxSingleTransformerBlock(name=f"single_transformer_blocks_{i}", **heads)(joined, temb, cos, sin)
        tokens = joined[:, text.shape[1]:]

        scale, shift = AdaModulation(2, name="norm_out", **kw)(temb)  # AdaLayerNormContinuous: scale first
        tokens = modulate(layer_norm(**kw)(tokens), shift, scale)
        out_features = self.out_channels or self.in_channels
        out = dense(out_features, ("embed", None), "proj_out", zero=True, **kw)(tokens)
        return unpack_latents(out, height, width).astype(x.dtype)
