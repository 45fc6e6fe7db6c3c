"""GroupNorm for the convolutional models (the VAE, UNet, UNet2DCondition), as torch's nn.GroupNorm.

y = (x - mean) / sqrt(var + eps) * scale + bias, with mean and (biased) variance over every
position and the channels of one group, per example. Parameters are Flax's (``scale``, ``bias``
of [C]), so checkpoints written with `flax.linen.GroupNorm` read unchanged.

The statistics are per-channel column sums of x and x^2 over the positions ([B, N, C] -> [B, C]),
then summed within each group: XLA:CPU reduces a [B, N, G, C/G] block across its two inner axes at
about a tenth of the speed it sums columns (594 against 54 ms of an SD-shaped VAE decoder's 1.4 s).
The variance is E[x^2] - E[x]^2 in float32, clamped at zero, as Flax's ``use_fast_variance``;
statistics and normalization are computed in float32 whatever the input's dtype.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class GroupNorm(nn.Module):
    """x [B, ..., C] -> normalized over (positions, channels of a group) per example and group."""

    num_groups: int
    epsilon: float = 1e-5
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        channels = x.shape[-1]
        if channels % self.num_groups:
            raise ValueError(f"GroupNorm {self.name!r}: {channels} channels do not split into "
                             f"{self.num_groups} groups; give a num_groups that divides the channel count")
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                           (channels,), self.param_dtype)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)),
                          (channels,), self.param_dtype)
        batch, per_group = x.shape[0], channels // self.num_groups
        flat = x.astype(jnp.float32).reshape(batch, -1, channels)
        count = flat.shape[1] * per_group
        sums = flat.sum(axis=1).reshape(batch, self.num_groups, per_group).sum(-1)
        squares = jnp.square(flat).sum(axis=1).reshape(batch, self.num_groups, per_group).sum(-1)
        mean = sums / count
        variance = jnp.maximum(squares / count - jnp.square(mean), 0.0)
        # y = x * mul + add per (example, channel): one multiply-add over the activations
        mul = jnp.repeat(jax.lax.rsqrt(variance + self.epsilon), per_group, axis=-1) * scale.astype(jnp.float32)
        add = bias.astype(jnp.float32) - jnp.repeat(mean, per_group, axis=-1) * mul
        return (flat * mul[:, None, :] + add[:, None, :]).reshape(x.shape).astype(self.dtype)
