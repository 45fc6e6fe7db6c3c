"""An explicit key/value cache for autoregressive decoding.

The cache is an ordinary pytree that a decoder takes as an argument and returns updated, so a
generation loop can carry it through `jax.lax.while_loop` or `jax.lax.scan` (it is not a Flax
mutable collection). Slot ``s`` of a row holds the key and value of the token at position ``s``;
``lengths[b]`` counts the positions of row b that hold real tokens, and the next token of that
row goes to slot ``lengths[b]``.

Layout, per layer: ``k`` and ``v`` are ``[batch, max_len, kv_heads, head_dim]``. An unscanned
decoder keeps a tuple of them, one per layer; a decoder built with ``scan_layers`` keeps one
stacked array ``[num_layers, batch, max_len, kv_heads, head_dim]`` so the scan slices it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """Per-layer keys and values plus each row's filled length.

    Attributes:
      k, v: a tuple of ``[B, S, KV, D]`` arrays (one per layer), or one ``[L, B, S, KV, D]`` array.
      lengths: ``[B]`` int32, the number of positions written in each row.
    """

    k: Any
    v: Any
    lengths: jax.Array

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, (tuple, list))

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def max_len(self) -> int:
        return int((self.k if self.stacked else self.k[0]).shape[-3])

    @property
    def num_layers(self) -> int:
        return int(self.k.shape[0]) if self.stacked else len(self.k)

    def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values of layer i."""
        return self.k[i], self.v[i]

    def repeat(self, n: int) -> "KVCache":
        """Each row repeated n times in place (row b becomes rows b*n .. b*n+n-1)."""
        axis = 1 if self.stacked else 0
        rep = lambda x: jnp.repeat(x, n, axis=axis)  # noqa: E731
        k = rep(self.k) if self.stacked else tuple(rep(x) for x in self.k)
        v = rep(self.v) if self.stacked else tuple(rep(x) for x in self.v)
        return KVCache(k=k, v=v, lengths=jnp.repeat(self.lengths, n, axis=0))


def init_kv_cache(
    *,
    num_layers: int,
    batch_size: int,
    max_len: int,
    kv_heads: int,
    head_dim: int,
    dtype: Any = jnp.float32,
    stacked: bool = False,
) -> KVCache:
    """An empty cache (zeros, every length 0)."""
    shape = (batch_size, max_len, kv_heads, head_dim)
    if stacked:
        k = jnp.zeros((num_layers,) + shape, dtype)
        v = jnp.zeros((num_layers,) + shape, dtype)
    else:
        k = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        v = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    return KVCache(k=k, v=v, lengths=jnp.zeros((batch_size,), jnp.int32))


def write_kv(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Write ``new [B, T, KV, D]`` into ``cache [B, S, KV, D]`` at slots ``positions [B, T]``.

    Positions outside the cache are dropped (the caller checks lengths before decoding).
    """
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, positions].set(new.astype(cache.dtype), mode="drop")
