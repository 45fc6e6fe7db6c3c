"""The pieces every decoder attention shares: the initializer scale, logically named dense layers,
RMSNorm, and the context length RoPE scaling reads (CausalTransformer's SelfAttention and
DeepSeek's LatentAttention both build on them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

INIT_STD = 0.02  # N(0, 0.02) for every weight, as in GPT-2 / Llama's initializer_range


def named_dense(features, axes, name, *, use_bias=False, std=INIT_STD, dtype, param_dtype):
    """nn.Dense with logically named kernel [in, out] and bias [out]."""
    return nn.Dense(
        features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nn.with_logical_partitioning(nn.initializers.normal(std), axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[-1:]),
        name=name,
    )


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * scale, computed in float32 like HF's LlamaRMSNorm."""

    eps: float = 1e-6
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
            (x.shape[-1],), self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return normed.astype(self.dtype) * scale.astype(self.dtype)


def rope_context(rope_scaling: Mapping[str, Any] | None, max_seq_len: int) -> int:
    """The context length RoPE scaling reads (HF's max_position_embeddings).

    A checkpoint's context length can differ from the ``max_seq_len`` a user runs it at, so
    ``rope_scaling["max_position_embeddings"]`` (a Dew key) overrides it.
    """
    if rope_scaling is not None and rope_scaling.get("max_position_embeddings"):
        return int(rope_scaling["max_position_embeddings"])
    return max_seq_len
