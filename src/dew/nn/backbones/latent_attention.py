"""Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, section 2.1; kept by DeepSeek-V3).

Keys and values are computed from one small latent per token, so a KV cache holds that latent
(and one rotated key shared by the heads) instead of every head's keys and values:

    q            = q_b(norm(q_a(x)))  or  q_proj(x)          [heads, nope + rope] (q_lora_rank or None)
    latent, k_r  = split(kv_a(x), [kv_lora_rank, rope])     one latent and one shared rope key per token
    latent       = norm(latent)
    k_n, v       = split(kv_b(latent), [nope, v])           per head
    q_n, q_r     = split(q, [nope, rope]);  q_r, k_r = rope(q_r), rope(k_r)
    out          = softmax([q_n, q_r] . [k_n, k_r] * scale) v    then o_proj

``scale`` is ``1 / sqrt(nope + rope)``, times YaRN's ``mscale**2`` when the RoPE scaling sets
``mscale_all_dim``, as the released configs do. Training and a call without a cache compute every
head's keys and values. With a cache, the call goes through the absorbed projections (the paper's
"absorb" trick): ``q_n . k_n = (q_n W_uk^T) . latent``, so a query is mapped into the latent space
once and scores against the cached latents directly, and ``p v = (p latent) W_uv``, so the heads'
values are never formed. The cache is a `KVCache` with one key/value head whose keys are
``[latent, k_r]`` (``kv_lora_rank + rope`` wide) and whose values are empty: the value product
reads the latent part of the keys.

``rope_interleave`` (DeepSeek's checkpoints) rotates pairs of adjacent features ``(x0, x1), (x2,
x3), ...``; it equals the rotate-half RoPE of the features reordered evens-then-odds, which is how
it is computed here (queries and keys are reordered alike, so their products are unchanged).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.checks import count
from dew.nn.attention import attention_mask, dot_product_attention
from dew.nn.backbones.decoder_parts import INIT_STD, RMSNorm, named_dense, rope_context
from dew.nn.kv_cache import write_kv
from dew.nn.rope import apply_rope, rope_cos_sin, rope_frequencies

SETTINGS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank",
            "rope_interleave")


def yarn_softmax_mscale(rope_scaling: Mapping[str, Any] | None) -> float:
    """The factor on the softmax scale a YaRN config with ``mscale_all_dim`` asks for: ``mscale**2``
    with ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1`` (1 when the factor is at most 1)."""
    if not rope_scaling or not rope_scaling.get("mscale_all_dim"):
        return 1.0
    factor = float(rope_scaling.get("factor", 1.0))
    if factor <= 1:
        return 1.0
    mscale = 0.1 * float(rope_scaling["mscale_all_dim"]) * math.log(factor) + 1.0
    return mscale * mscale


class KernelOnly(nn.Module):
    """A dense projection's ``kernel [in, out]`` handed back unapplied (for the absorbed products)."""

    features: int
    axes: tuple[str | None, str | None]
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, in_features: int) -> jax.Array:
        init = nn.with_logical_partitioning(nn.initializers.normal(INIT_STD), self.axes)
        return self.param("kernel", init, (in_features, self.features), self.param_dtype)


class LatentAttention(nn.Module):
    """Multi-head latent attention; called like `SelfAttention`, returns ``(out, new_layer_cache)``."""

    num_heads: int
    num_layers: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = False
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    max_seq_len: int = 2048
    norm_eps: float = 1e-6
    causal: bool = True
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            count(getattr(self, name), f"latent_attention {name}")
        count(self.q_lora_rank, "latent_attention q_lora_rank", optional=True)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"latent_attention qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
        super().__post_init__()

    # --- sizes, in plain sight -------------------------------------------------------------------

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """The width of one cached token: its latent and its shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.qk_head_dim ** -0.5 * yarn_softmax_mscale(self.rope_scaling)

    # --- projections -----------------------------------------------------------------------------

    def _rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """RoPE over the last axis of ``x [B, T, heads, rope]`` (interleaved pairs when asked)."""
        if self.rope_interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        inv_freq, attention_factor = rope_frequencies(
            self.qk_rope_head_dim, self.rope_theta, self.rope_scaling,
            rope_context(self.rope_scaling, self.max_seq_len),
        )
        cos, sin = rope_cos_sin(positions, inv_freq, attention_factor)
        return apply_rope(x, cos, sin)

    @nn.compact
    def __call__(self, x, positions, segment_ids=None, layer_cache=None, slots=None, window=None):
        if window is not None:
            raise ValueError("latent attention has no sliding window; use full-attention layers")
        batch, length, emb = x.shape
        heads, nope, rope = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        norm = dict(eps=self.norm_eps, dtype=self.dtype, param_dtype=self.param_dtype)
        rows = x.reshape(batch * length, emb)

        if self.q_lora_rank is None:
            q = named_dense(heads * self.qk_head_dim, ("embed", "heads"), "q_proj", **dense)(rows)
        else:
            q = named_dense(self.q_lora_rank, ("embed", None), "q_a_proj", **dense)(rows)
            q = RMSNorm(name="q_a_layernorm", **norm)(q)
            q = named_dense(heads * self.qk_head_dim, (None, "heads"), "q_b_proj", **dense)(q)
        q = q.reshape(batch, length, heads, self.qk_head_dim)
        q_nope, q_rope = q[..., :nope], self._rotate(q[..., nope:], positions)

        compressed = named_dense(self.cache_width, ("embed", None), "kv_a_proj_with_mqa", **dense)(rows)
        latent = RMSNorm(name="kv_a_layernorm", **norm)(compressed[:, : self.kv_lora_rank])
        latent = latent.reshape(batch, length, self.kv_lora_rank)
        k_rope = self._rotate(compressed[:, self.kv_lora_rank:].reshape(batch, length, 1, rope), positions)
        kv_b = KernelOnly(heads * (nope + self.v_head_dim), (None, "heads"), self.param_dtype,
                          name="kv_b_proj")(self.kv_lora_rank).astype(self.dtype)

        if layer_cache is None:
            out = self._expanded(q_nope, q_rope, latent, k_rope, kv_b, segment_ids)
            new_cache = None
        else:
            out, new_cache = self._absorbed(q_nope, q_rope, latent, k_rope, kv_b, positions, layer_cache, slots)

        out_std = INIT_STD / math.sqrt(2 * self.num_layers)  # GPT-2's scaled residual init
        out = named_dense(emb, ("heads", "embed"), "o_proj", std=out_std, **dense)(
            out.reshape(batch * length, heads * self.v_head_dim))
        return out.reshape(batch, length, emb), new_cache

    def _expanded(self, q_nope, q_rope, latent, k_rope, kv_b, segment_ids):
        """Attention over every head's keys and values, formed from the latents (training, prefill)."""
        batch, length, heads, nope = q_nope.shape
        kv = (latent @ kv_b).reshape(batch, length, heads, nope + self.v_head_dim)
        k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_rope, (batch, length, heads, self.qk_rope_head_dim))],
                            axis=-1)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        v = kv[..., nope:]
        width = max(self.qk_head_dim, self.v_head_dim)  # one kernel takes one head width: pad with zeros
        pad = lambda a: jnp.pad(a, ((0, 0),) * 3 + ((0, width - a.shape[-1]),))  # noqa: E731
        out = dot_product_attention(pad(q), pad(k), pad(v), segment_ids=segment_ids, causal=self.causal,
                                    scale=self.scale, impl=self.attention_impl)
        return out[..., : self.v_head_dim]

    def _absorbed(self, q_nope, q_rope, latent, k_rope, kv_b, positions, layer_cache, slots):
        """Attention over the cached latents through the absorbed projections; writes this call's tokens."""
        batch, length, heads, nope = q_nope.shape
        rank = self.kv_lora_rank
        kernels = kv_b.reshape(rank, heads, nope + self.v_head_dim)
        w_uk, w_uv = kernels[..., :nope], kernels[..., nope:]
        kv_positions, index, page_table = slots
        if page_table is not None:
            raise ValueError("latent attention decodes from a dense cache of latents, not from pages")
        cache_k, cache_v = layer_cache
        token = jnp.concatenate([latent[:, :, None, :], k_rope], axis=-1)  # [B, T, 1, rank + rope]
        cache_k, cache_v = write_kv(cache_k, cache_v, token, token[..., :0], index)

        q_latent = jnp.einsum("bthn,rhn->bthr", q_nope, w_uk)
        q = jnp.concatenate([q_latent, q_rope], axis=-1).astype(cache_k.dtype)  # [B, T, H, rank + rope]
        accumulate = jnp.promote_types(q.dtype, jnp.float32)
        # cache_k is [B, rank + rope, S] (one key/value head): every head's queries score against it
        logits = jnp.einsum("bthc,bcs->bhts", q, cache_k, preferred_element_type=accumulate)
        logits = logits * jnp.asarray(self.scale, accumulate)
        mask = attention_mask(positions, kv_positions, causal=self.causal)  # [B, 1, T, S]
        mask = mask & (jnp.atleast_2d(kv_positions) >= 0)[:, None, None, :]
        logits = jnp.where(mask, logits, jnp.finfo(accumulate).min)
        weights = jax.nn.softmax(logits, axis=-1).astype(cache_k.dtype)
        out_latent = jnp.einsum("bhts,brs->bthr", weights, cache_k[:, :rank, :], preferred_element_type=accumulate)
        out = jnp.einsum("bthr,rhv->bthv", out_latent.astype(self.dtype), w_uv)
        return out, (cache_k, cache_v)


def latent_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` checked to name only `LatentAttention`'s own options (the model passes the rest)."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"latent_attention= does not take {unknown}; its settings are {list(SETTINGS)}")
    missing = sorted({"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"} - set(settings))
    if missing:
        raise ValueError(f"latent_attention= needs {missing}")
    return dict(settings)

