"""UNet2DCondition: the text-conditioned latent UNet of Stable Diffusion 1.x / 2.x and SDXL
(Rombach et al. 2022, "High-Resolution Image Synthesis with Latent Diffusion Models"; Podell et al.
2023, "SDXL"), built like diffusers' ``UNet2DConditionModel`` so its checkpoints load by renaming.

    emb = time_embedding(sinusoid(timesteps))              width 4 * block_out_channels[0]
          (+ add_embedding([text_embeds, sinusoid(time_ids)]) for SDXL's "text_time")
    conv_in (3x3, block_out_channels[0]); its output is the first skip
    down_blocks_l: layers_per_block[l] x [ResnetBlock2D (+ Transformer2D when cross-attention)],
                   then a stride-2 3x3 conv but at the last level; every output is kept as a skip
    mid_block:     ResnetBlock2D, Transformer2D, ResnetBlock2D
    up_blocks_l:   levels widest first, (layers_per_block + 1) x [concat a skip, ResnetBlock2D
                   (+ Transformer2D)], then nearest upsampling to the next skip's size + 3x3 conv
    GroupNorm -> SiLU -> conv_out (3x3, out_channels)

A ResnetBlock2D is GroupNorm -> SiLU -> conv1, plus a projection of SiLU(emb), GroupNorm -> SiLU ->
conv2, added to the (1x1-projected) input. A Transformer2D is GroupNorm (eps 1e-6) -> proj_in (1x1
conv for SD 1.x, linear for SD 2.x / SDXL) -> transformer_layers x [LN -> self-attention, LN ->
cross-attention over ``encoder_hidden_states``, LN -> GEGLU feed-forward, each added back] ->
proj_out, added to its input.

Heads: ``num_attention_heads`` is the head count per level (diffusers' config calls it
``attention_head_dim``); a level of width C runs heads of width C / heads. Timesteps are the
scheduler's discrete steps 0..999 (floats; fractions are fine), as diffusers' pipelines pass them.
Parameter names follow diffusers' (``down_blocks_0/attentions_0/transformer_blocks_0/attn2/to_k``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn.attention import check_attention_impl
from dew.nn.backbones.dit import check_image
from dew.nn.embeddings import check_conditions, dense
from dew.nn.norms import GroupNorm
from dew.nn.vae import UpsampleConv, conv
from dew.nn.vit import attend

CROSS_ATTENTION_DOWN = "CrossAttnDownBlock2D"
PLAIN_DOWN = "DownBlock2D"
CROSS_ATTENTION_UP = "CrossAttnUpBlock2D"
PLAIN_UP = "UpBlock2D"
TRANSFORMER_NORM_EPS = 1e-6  # Transformer2DModel's GroupNorm
LAYER_NORM_EPS = 1e-5  # BasicTransformerBlock's LayerNorms


def timestep_features(timesteps: jax.Array, features: int, flip_sin_to_cos: bool, freq_shift: float,
                      max_period: float = 10000.0) -> jax.Array:
    """[N] reals -> [N, features] sinusoids, as diffusers' ``get_timestep_embedding``.

    Frequency i of ``half = features // 2`` is ``max_period^(-i / (half - freq_shift))``; the sines
    come first unless ``flip_sin_to_cos`` (SD's setting, cosines first). An odd width pads a zero.
    """
    half = features // 2
    exponent = -math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / (half - freq_shift)
    args = timesteps.astype(jnp.float32)[:, None] * jnp.exp(exponent)[None, :]
    first, second = (jnp.cos(args), jnp.sin(args)) if flip_sin_to_cos else (jnp.sin(args), jnp.cos(args))
    out = jnp.concatenate([first, second], axis=-1)
    return jnp.pad(out, ((0, 0), (0, features % 2)))


def layer_norm(name: str, *, dtype: Any, param_dtype: Any) -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=LAYER_NORM_EPS, dtype=dtype, param_dtype=param_dtype,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)),
        name=name,
    )


class TimestepEmbedding(nn.Module):
    """[B, in] -> linear_1 -> SiLU -> linear_2 -> [B, features] (diffusers' TimestepEmbedding)."""

    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h = dense(self.features, (None, "embed"), "linear_1", **kw)(x)
        return dense(self.features, ("embed", "mlp"), "linear_2", **kw)(nn.silu(h))


class ResnetBlock2D(nn.Module):
    """GroupNorm -> SiLU -> conv1 (+ time_emb_proj(SiLU(emb))) -> GroupNorm -> SiLU -> conv2, plus the input.

    ``output_scale_factor`` divides the sum (diffusers' mid_block_scale_factor; 1 in SD).
    """

    features: int
    num_groups: int
    eps: float
    output_scale_factor: float = 1.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, emb: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h = nn.silu(GroupNorm(self.num_groups, self.eps, name="norm1", **kw)(x))
        h = conv(self.features, "conv1", **kw)(h)
        h = h + dense(self.features, ("embed", "mlp"), "time_emb_proj", **kw)(nn.silu(emb))[:, None, None, :]
        h = nn.silu(GroupNorm(self.num_groups, self.eps, name="norm2", **kw)(h))
        h = conv(self.features, "conv2", **kw)(h)
        if x.shape[-1] != self.features:
            x = conv(self.features, "conv_shortcut", kernel=1, **kw)(x)
        return (x + h) / self.output_scale_factor


class Attention(nn.Module):
    """Multi-head attention of x [B, N, D] over ``context`` [B, L, Dc] (x itself when None).

    to_q, to_k, to_v have no bias, to_out does (diffusers' Attention with bias=False).
    ``upcast`` runs the scores, softmax and weighted sum in float32 (SD 2.1's upcast_attention).
    """

    num_heads: int
    upcast: bool = False
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array | None = None) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        context = x if context is None else context
        batch, width = x.shape[0], x.shape[-1]
        head_width = width // self.num_heads
        q, k, v = (
            dense(width, ("embed", "heads"), name, use_bias=False, **kw)(source)
            .reshape(batch, source.shape[1], self.num_heads, head_width)
            for name, source in (("to_q", x), ("to_k", context), ("to_v", context))
        )
        if self.upcast:
            q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
        out = attend(q, k, v, impl=self.attention_impl).astype(self.dtype)
        return dense(width, ("heads", "embed"), "to_out_0", **kw)(out)


class FeedForward(nn.Module):
    """GEGLU: net_0/proj to 2 x 4D, value * GELU(gate) (exact GELU), then net_2 back to D."""

    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        width = x.shape[-1]
        value, gate = jnp.split(dense(8 * width, ("embed", "mlp"), "net_0/proj", **kw)(x), 2, axis=-1)
        return dense(width, ("mlp", "embed"), "net_2", **kw)(value * nn.gelu(gate, approximate=False))


class BasicTransformerBlock(nn.Module):
    """Pre-LN self-attention, cross-attention over the text tokens, GEGLU feed-forward; each residual."""

    num_heads: int
    upcast_attention: bool = False
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        attention = dict(num_heads=self.num_heads, upcast=self.upcast_attention,
                         attention_impl=self.attention_impl, **kw)
        x = x + Attention(name="attn1", **attention)(layer_norm("norm1", **kw)(x))
        x = x + Attention(name="attn2", **attention)(layer_norm("norm2", **kw)(x), context)
        return x + FeedForward(name="ff", **kw)(layer_norm("norm3", **kw)(x))


class Transformer2D(nn.Module):
    """GroupNorm -> proj_in -> ``num_layers`` BasicTransformerBlocks over the H*W tokens -> proj_out, plus the input.

    ``linear_projection`` makes proj_in / proj_out linear layers over tokens (SD 2.x, SDXL)
    instead of 1x1 convs over the map (SD 1.x); both give the same function, not the same params.
    """

    num_heads: int
    num_layers: int
    num_groups: int
    linear_projection: bool = False
    upcast_attention: bool = False
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        batch, height, width, channels = x.shape
        h = GroupNorm(self.num_groups, TRANSFORMER_NORM_EPS, name="norm", **kw)(x)
        if self.linear_projection:
            h = dense(channels, ("embed", "heads"), "proj_in", **kw)(h.reshape(batch, height * width, channels))
        else:
            h = conv(channels, "proj_in", kernel=1, **kw)(h).reshape(batch, height * width, channels)
        for i in range(self.num_layers):
            h = BasicTransformerBlock(self.num_heads, self.upcast_attention, self.attention_impl,
                                      name=f"transformer_blocks_{i}", **kw)(h, context)
        if self.linear_projection:
            h = dense(channels, ("heads", "embed"), "proj_out", **kw)(h).reshape(x.shape)
        else:
            h = conv(channels, "proj_out", kernel=1, **kw)(h.reshape(x.shape))
        return x + h


def _per_level(value: int | Sequence[int], levels: int, name: str) -> tuple[int, ...]:
    """An int setting repeated per level, or a per-level list checked for length."""
    if isinstance(value, int):
        return (value,) * levels
    value = tuple(int(v) for v in value)
    if len(value) != levels:
        raise ValueError(
            f"UNet2DCondition: {name}={value} has {len(value)} entries for {levels} levels "
            "(one per block_out_channels entry); give one per level or a single int"
        )
    return value


class UNet2DCondition(nn.Module):
    """Stable Diffusion's text-conditioned UNet over latents [B, H, W, in_channels] (see the module doc).

    Defaults are SD 1.5's. ``__call__(x, timesteps, conditions)``: ``timesteps`` [B] (or a scalar)
    in the scheduler's 0..999 steps; ``conditions["encoder_hidden_states"]`` [B, L,
    cross_attention_dim] text tokens, and with ``addition_embed_type="text_time"`` (SDXL)
    ``"text_embeds"`` [B, pooled] and ``"time_ids"`` [B, n] (SDXL's six size and crop numbers).
    Returns what the checkpoint predicts (epsilon or v) as [B, H, W, out_channels].
    """

    in_channels: int = 4
    out_channels: int = 4
    block_out_channels: Sequence[int] = (320, 640, 1280, 1280)
    down_block_types: Sequence[str] = (CROSS_ATTENTION_DOWN,) * 3 + (PLAIN_DOWN,)
    up_block_types: Sequence[str] = (PLAIN_UP,) + (CROSS_ATTENTION_UP,) * 3
    layers_per_block: int | Sequence[int] = 2
    transformer_layers_per_block: int | Sequence[int] = 1
    num_attention_heads: int | Sequence[int] = 8
    cross_attention_dim: int = 768
    use_linear_projection: bool = False
    upcast_attention: bool = False
    flip_sin_to_cos: bool = True
    freq_shift: float = 0.0
    norm_num_groups: int = 32
    norm_eps: float = 1e-5
    downsample_padding: int = 1
    mid_block_scale_factor: float = 1.0
    addition_embed_type: str | None = None
    addition_time_embed_dim: int | None = None
    projection_class_embeddings_input_dim: int | None = None
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def _check_structure(self) -> None:
        levels = len(self.block_out_channels)
        down, up = tuple(self.down_block_types), tuple(self.up_block_types)
        known_down = (CROSS_ATTENTION_DOWN, PLAIN_DOWN)
        if len(down) != levels or any(kind not in known_down for kind in down):
            raise ValueError(
                f"UNet2DCondition: down_block_types={down} must name one of {known_down} per level "
                f"({levels} levels from block_out_channels)"
            )
        mirrored = tuple(CROSS_ATTENTION_UP if kind == CROSS_ATTENTION_DOWN else PLAIN_UP for kind in reversed(down))
        if up != mirrored:
            raise ValueError(
                f"UNet2DCondition: up_block_types={up} must mirror down_block_types={down}, i.e. {mirrored} "
                "(an up level attends exactly when its down level does)"
            )
        for level, (features, heads) in enumerate(zip(self.block_out_channels, self.heads)):
            if features % self.norm_num_groups or features % heads:
                raise ValueError(
                    f"UNet2DCondition: level {level} has width {features}, which must be a multiple of "
                    f"norm_num_groups={self.norm_num_groups} and of its num_attention_heads={heads}"
                )
        if self.addition_embed_type not in (None, "text_time"):
            raise ValueError(
                f"UNet2DCondition: addition_embed_type={self.addition_embed_type!r}; Dew builds None "
                "(SD 1.x / 2.x) or 'text_time' (SDXL)"
            )
        if self.addition_embed_type == "text_time" and (
                self.addition_time_embed_dim is None or self.projection_class_embeddings_input_dim is None):
            raise ValueError(
                "UNet2DCondition: addition_embed_type='text_time' needs addition_time_embed_dim and "
                "projection_class_embeddings_input_dim (the pooled width + len(time_ids) * addition_time_embed_dim)"
            )

    @property
    def heads(self) -> tuple[int, ...]:
        return _per_level(self.num_attention_heads, len(self.block_out_channels), "num_attention_heads")

    @property
    def downsampling(self) -> int:
        """How many latent pixels of each side one deepest-level pixel covers."""
        return 2 ** (len(self.block_out_channels) - 1)

    def _text(self, conditions: Mapping[str, Any], batch: int) -> jax.Array:
        text = conditions.get("encoder_hidden_states")
        if text is None or len(jnp.shape(text)) != 3 or jnp.shape(text)[0] != batch \
                or jnp.shape(text)[2] != self.cross_attention_dim:
            got = "nothing" if text is None else f"shape {tuple(jnp.shape(text))}"
            raise ValueError(
                f"UNet2DCondition: conditions['encoder_hidden_states'] must be [{batch}, tokens, "
                f"{self.cross_attention_dim}] text-encoder states (cross_attention_dim="
                f"{self.cross_attention_dim}); got {got}"
            )
        return jnp.asarray(text, self.dtype)

    def _added_embedding(self, conditions: Mapping[str, Any], batch: int) -> jax.Array:
        """SDXL's text_time input: [text_embeds, sinusoids of each time id] -> [B, projection input]."""
        text_embeds, time_ids = conditions.get("text_embeds"), conditions.get("time_ids")
        if text_embeds is None or time_ids is None:
            raise ValueError(
                "UNet2DCondition with addition_embed_type='text_time' (SDXL) needs conditions 'text_embeds' "
                "[batch, pooled] (the pooled text embedding) and 'time_ids' [batch, 6] (original size, "
                "crop top-left, target size); got " + ", ".join(sorted(conditions))
            )
        text_embeds, time_ids = jnp.asarray(text_embeds, jnp.float32), jnp.asarray(time_ids, jnp.float32)
        if text_embeds.ndim != 2 or time_ids.ndim != 2 or text_embeds.shape[0] != batch or time_ids.shape[0] != batch \
                or text_embeds.shape[1] + time_ids.shape[1] * self.addition_time_embed_dim \
                != self.projection_class_embeddings_input_dim:
            raise ValueError(
                f"UNet2DCondition: text_embeds {tuple(text_embeds.shape)} and time_ids {tuple(time_ids.shape)} "
                f"must be [{batch}, pooled] and [{batch}, n] with pooled + n * {self.addition_time_embed_dim} "
                f"(addition_time_embed_dim) = {self.projection_class_embeddings_input_dim} "
                "(projection_class_embeddings_input_dim)"
            )
        time_embeds = timestep_features(time_ids.reshape(-1), self.addition_time_embed_dim,
                                        self.flip_sin_to_cos, self.freq_shift).reshape(batch, -1)
        return jnp.concatenate([text_embeds, time_embeds], axis=-1).astype(self.dtype)

    @nn.compact
    def __call__(self, x: jax.Array, timesteps: jax.Array,
                 conditions: Mapping[str, Any] | None = None) -> jax.Array:
        name = type(self).__name__
        check_attention_impl(self.attention_impl)
        check_image(x, 4, name, f"[batch, height, width, {self.in_channels}]")
        self._check_structure()
        accepted = {
            "encoder_hidden_states": f"float [batch, tokens, {self.cross_attention_dim}] text-encoder states"}
        if self.addition_embed_type == "text_time":
            accepted["text_embeds"] = "float [batch, pooled] pooled text embedding (SDXL)"
            accepted["time_ids"] = "float [batch, 6] original size, crop top-left, target size (SDXL)"
        conditions = check_conditions(conditions, accepted, name)
        batch = x.shape[0]
        if x.shape[-1] != self.in_channels:
            raise ValueError(f"{name}: input has {x.shape[-1]} channels; the model takes in_channels={self.in_channels}")
        timesteps = jnp.asarray(timesteps, jnp.float32)
        if timesteps.ndim > 1 or timesteps.size not in (1, batch):
            raise ValueError(f"{name}: timesteps must be [{batch}] or a scalar; got shape {tuple(timesteps.shape)}")
        timesteps = jnp.broadcast_to(timesteps.reshape(-1), (batch,))
        text = self._text(conditions, batch)

        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        levels = len(self.block_out_channels)
        widths = tuple(self.block_out_channels)
        layers = _per_level(self.layers_per_block, levels, "layers_per_block")
        depths = _per_level(self.transformer_layers_per_block, levels, "transformer_layers_per_block")
        resnet = dict(num_groups=self.norm_num_groups, eps=self.norm_eps, **kw)
        transformer = dict(num_groups=self.norm_num_groups, linear_projection=self.use_linear_projection,
                           upcast_attention=self.upcast_attention, attention_impl=self.attention_impl, **kw)

        features = timestep_features(timesteps, widths[0], self.flip_sin_to_cos, self.freq_shift)
        emb = TimestepEmbedding(4 * widths[0], name="time_embedding", **kw)(features.astype(self.dtype))
        if self.addition_embed_type == "text_time":
            emb = emb + TimestepEmbedding(4 * widths[0], name="add_embedding", **kw)(
                self._added_embedding(conditions, batch))

        h = conv(widths[0], "conv_in", **kw)(x.astype(self.dtype))
        skips = [h]
        for level, kind in enumerate(self.down_block_types):
            prefix = f"down_blocks_{level}"
            for i in range(layers[level]):
                h = ResnetBlock2D(widths[level], name=f"{prefix}/resnets_{i}", **resnet)(h, emb)
                if kind == CROSS_ATTENTION_DOWN:
                    h = Transformer2D(self.heads[level], depths[level], name=f"{prefix}/attentions_{i}",
                                      **transformer)(h, text)
                skips.append(h)
            if level != levels - 1:
                # diffusers' Downsample2D: padding 0 pads only the far row and column
                pad = self.downsample_padding
                padding = ((0, 1), (0, 1)) if pad == 0 else ((pad, pad), (pad, pad))
                h = conv(widths[level], f"{prefix}/downsamplers_0/conv", stride=2, padding=padding, **kw)(h)
                skips.append(h)

        mid = dict(resnet, output_scale_factor=self.mid_block_scale_factor)
        h = ResnetBlock2D(widths[-1], name="mid_block/resnets_0", **mid)(h, emb)
        h = Transformer2D(self.heads[-1], depths[-1], name="mid_block/attentions_0", **transformer)(h, text)
        h = ResnetBlock2D(widths[-1], name="mid_block/resnets_1", **mid)(h, emb)

        for up, kind in enumerate(self.up_block_types):
            level = levels - 1 - up
            prefix = f"up_blocks_{up}"
            for i in range(layers[level] + 1):
                h = jnp.concatenate([h, skips.pop()], axis=-1)
                h = ResnetBlock2D(widths[level], name=f"{prefix}/resnets_{i}", **resnet)(h, emb)
                if kind == CROSS_ATTENTION_UP:
                    h = Transformer2D(self.heads[level], depths[level], name=f"{prefix}/attentions_{i}",
                                      **transformer)(h, text)
            if level != 0:
                h = UpsampleConv(widths[level], name=f"{prefix}/upsamplers_0/conv", **kw)(h, skips[-1].shape[1:3])

        h = nn.silu(GroupNorm(self.norm_num_groups, self.norm_eps, name="conv_norm_out", **kw)(h))
        return conv(self.out_channels, "conv_out", **kw)(h).astype(x.dtype)
