"""T5's encoder (Raffel et al. 2020): the long-prompt encoder of SD3 and Flux (T5 v1.1 XXL).

    x = shared[ids]                                    (no scaling, no position table)
    num_layers x pre-norm blocks:
        x = x + o(attention(RMSNorm(x)) + position bias)   scores are q . k, unscaled
        x = x + wo(act(wi(RMSNorm(x))))                    or wo(act(wi_0(h)) * wi_1(h)) when gated
    out = RMSNorm(x)

The position bias is learned per head over relative-position buckets and shared by every layer
(the first block holds it). Half the buckets take keys after the query, half keys before; within
each half, distances below ``num_buckets / 4`` get a bucket each and longer ones share
logarithmically wider buckets up to ``max_distance`` (section 2.1 of the paper). RMSNorm has no
mean subtraction and no bias, and is computed in float32.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn.embeddings import dense
from dew.nn.text_encoders.activations import activation


def relative_position_buckets(length: int, num_buckets: int, max_distance: int) -> jax.Array:
    """[length, length] bucket ids of (key position - query position), bidirectional."""
    positions = jnp.arange(length)
    relative = positions[None, :] - positions[:, None]
    half = num_buckets // 2
    buckets = jnp.where(relative > 0, half, 0)
    distance = jnp.abs(relative)
    exact = half // 2
    wide = exact + (
        jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / exact)
        / math.log(max_distance / exact) * (half - exact)
    ).astype(jnp.int32)
    wide = jnp.minimum(wide, half - 1)
    return buckets + jnp.where(distance < exact, distance, wide)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, in float32 (T5LayerNorm)."""

    eps: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                           (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * scale.astype(jnp.float32)).astype(self.dtype)


class T5Attention(nn.Module):
    """Bidirectional self-attention without biases or score scaling, plus the position bias."""

    num_heads: int
    head_dim: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, bias: jax.Array, mask: jax.Array | None) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype, use_bias=False)
        batch, length, features = x.shape
        inner = self.num_heads * self.head_dim

        def heads(name):
            return dense(inner, ("embed", "heads"), name, **kw)(x).reshape(batch, length, self.num_heads, self.head_dim)

        q, k, v = heads("q"), heads("k"), heads("v")
        scores = jnp.einsum("bqnh,bknh->bnqk", q, k).astype(jnp.float32) + bias
        if mask is not None:
            scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bnqk,bknh->bqnh", weights, v).reshape(batch, length, inner)
        return dense(features, ("heads", "embed"), "o", **kw)(out)


class T5FeedForward(nn.Module):
    """wo(act(wi(x))), or wo(act(wi_0(x)) * wi_1(x)) when ``gated`` (T5 v1.1's gated-gelu)."""

    d_ff: int
    act: str
    gated: bool
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype, use_bias=False)
        act = activation(self.act, "T5Encoder")
        if self.gated:
            h = act(dense(self.d_ff, ("embed", "mlp"), "wi_0", **kw)(x)) * dense(self.d_ff, ("embed", "mlp"), "wi_1", **kw)(x)
        else:
            h = act(dense(self.d_ff, ("embed", "mlp"), "wi", **kw)(x))
        return dense(x.shape[-1], ("mlp", "embed"), "wo", **kw)(h)


class T5Encoder(nn.Module):
    """T5EncoderModel: token ids [B, L] (and an optional attention mask, 1 = token) -> [B, L, d_model].

    Defaults are T5 v1.1 XXL's encoder (SD3 and Flux): gated-gelu with the tanh GELU. The original
    T5 uses ``act="relu"``, ``gated=False``.
    """

    vocab_size: int = 32128
    d_model: int = 4096
    d_kv: int = 64
    num_heads: int = 64
    d_ff: int = 10240
    num_layers: int = 24
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    act: str = "gelu_new"
    gated: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        if ids.ndim != 2:
            raise ValueError(f"T5Encoder takes token ids [batch, length]; got shape {tuple(ids.shape)}")
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        x = nn.Embed(self.vocab_size, self.d_model, name="shared", **kw,
                     embedding_init=nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed")))(ids)
        table = nn.Embed(self.relative_attention_num_buckets, self.num_heads, name="relative_attention_bias", **kw,
                         embedding_init=nn.with_logical_partitioning(nn.initializers.normal(1.0), (None, "heads")))
        buckets = relative_position_buckets(ids.shape[1], self.relative_attention_num_buckets,
                                            self.relative_attention_max_distance)
        bias = table(buckets).astype(jnp.float32).transpose(2, 0, 1)[None]  # [1, heads, L, L]
        mask = None if attention_mask is None else attention_mask[:, None, None, :].astype(bool)
        for i in range(self.num_layers):
            h = RMSNorm(self.layer_norm_epsilon, name=f"block_{i}/attention_norm", **kw)(x)
            x = x + T5Attention(self.num_heads, self.d_kv, name=f"block_{i}/attention", **kw)(h, bias, mask)
            h = RMSNorm(self.layer_norm_epsilon, name=f"block_{i}/ff_norm", **kw)(x)
            x = x + T5FeedForward(self.d_ff, self.act, self.gated, name=f"block_{i}/ff", **kw)(h)
        return RMSNorm(self.layer_norm_epsilon, name="final_layer_norm", **kw)(x)
