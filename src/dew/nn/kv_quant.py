"""Eight-bit storage for a KV cache: int8 over Hadamard-rotated keys, or unrotated float8 e4m3.

`encode` and `decode` work on any ``[..., heads, head_dim]`` block, whatever the cache's layout:
each head of each token keeps its own float32 scale, its largest magnitude over the largest code
(symmetric absmax: 127 for int8, 448 for e4m3), so one outlier token never coarsens another.

A few channels of a key carry most of its magnitude (RoPE pairs at low frequency), and int8's even
grid spends its range on them. Rotating every key by a normalized Hadamard matrix ``H`` (orthonormal
and symmetric, Sylvester's construction) spreads that magnitude over all channels before rounding;
rotating the query by the same matrix leaves every score unchanged, ``(q H) . (k H) = q . k``, so
attention reads the rotated codes as they are (QuaRot, arXiv:2404.00456). Sylvester's matrices exist
for powers of two only, hence int8's head_dim rule. e4m3 keeps relative precision at every
magnitude, so its keys are stored unrotated. Values are never rotated.

`Quantized` holds the codes and scales of one stored block in a cache's own layout: the scales
have the codes' rank with size 1 on the head_dim axis, so ``codes * scales`` is the block
dequantized in place, and a cache that moves rows (seat, repeat) or pages moves both alike.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dew.checks import one_of

QUANTIZED_FORMATS = ("int8", "float8_e4m3fn")
LARGEST_CODE = {"int8": 127.0, "float8_e4m3fn": 448.0}  # symmetric: -127..127 (never -128), e4m3's max


def check_quantized(quantized: str | None) -> str | None:
    """Return `quantized` (None: keys and values stored unquantized) or raise naming the formats."""
    if quantized is None:
        return None
    return one_of(quantized, QUANTIZED_FORMATS, "quantized", what="a KV cache storage format",
                  extra="None (the compute dtype)")


def rotates_keys(quantized: str | None) -> bool:
    """Whether this format stores keys Hadamard-rotated (int8 only)."""
    return quantized == "int8"


def check_head_dim(quantized: str | None, head_dim: int) -> None:
    """Raise when `quantized` cannot store heads of `head_dim` channels (int8 needs a power of two)."""
    if rotates_keys(quantized) and (head_dim < 1 or head_dim & (head_dim - 1)):
        lower = 1 << (head_dim.bit_length() - 1) if head_dim > 0 else 1
        raise ValueError(
            f"quantized='int8' rotates keys by a Hadamard matrix, which needs a power-of-two head_dim; "
            f"got head_dim={head_dim}. Use quantized='float8_e4m3fn' (any head_dim), or a model whose "
            f"head_dim is a power of two (e.g. {lower} or {lower * 2})"
        )


@functools.lru_cache(maxsize=None)
def hadamard(n: int) -> np.ndarray:
    """The ``[n, n]`` Hadamard matrix of Sylvester's construction over sqrt(n): orthonormal and symmetric."""
    check_head_dim("int8", n)
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    h = h / np.sqrt(n)
    h.setflags(write=False)
    return h


def rotate(x: jax.Array) -> jax.Array:
    """``x H`` over the last (head_dim) axis, computed in float32 and returned in x's dtype."""
    h = jnp.asarray(hadamard(x.shape[-1]), jnp.float32)
    return jnp.matmul(x.astype(jnp.float32), h, precision=jax.lax.Precision.HIGHEST).astype(x.dtype)


def encode(x: jax.Array, quantized: str) -> tuple[jax.Array, jax.Array]:
    """Codes ``[..., heads, head_dim]`` in the format's dtype and float32 scales ``[..., heads]``.

    ``decode(codes, scales)`` gives back x to within half a step of int8's grid (``scale / 2``), or
    to e4m3's 3-bit mantissa. A head whose channels are all zero gets scale 0 and codes 0.
    """
    largest = LARGEST_CODE[check_quantized(quantized)]
    x32 = x.astype(jnp.float32)
    scales = jnp.max(jnp.abs(x32), axis=-1) / largest
    safe = jnp.where(scales > 0, scales, 1.0)[..., None]
    y = jnp.clip(x32 / safe, -largest, largest)  # rounding of absmax / scale must not overflow the format
    if quantized == "int8":
        return jnp.round(y).astype(jnp.int8), scales
    return y.astype(jnp.float8_e4m3fn), scales


def decode(codes: jax.Array, scales: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """The block ``codes [..., heads, head_dim]`` encodes with ``scales [..., heads]``, in `dtype`."""
    return (codes.astype(jnp.float32) * scales[..., None]).astype(dtype)


@struct.dataclass
class Quantized:
    """One stored block of keys or values in a cache's layout: codes, and scales beside them.

    Attributes:
      codes: int8 or float8_e4m3fn, the cache's layout for keys or values.
      scales: float32 of the codes' rank, size 1 on the head_dim axis (one scale per token and head).
      rotated: whether the codes are of Hadamard-rotated vectors (int8 keys): a query must be
        rotated by the same matrix to read them.
    """

    codes: jax.Array
    scales: jax.Array
    rotated: bool = struct.field(pytree_node=False, default=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def quantized(self) -> str:
        """The storage format, "int8" or "float8_e4m3fn"."""
        return jnp.dtype(self.codes.dtype).name

    @classmethod
    def zeros(cls, shape: tuple[int, ...], head_dim_axis: int, quantized: str, *, rotated: bool) -> "Quantized":
        """An all-zero block of `shape` whose head_dim lies on `head_dim_axis`."""
        dtype = jnp.int8 if check_quantized(quantized) == "int8" else jnp.float8_e4m3fn
        scale_shape = list(shape)
        scale_shape[head_dim_axis] = 1
        return cls(jnp.zeros(shape, dtype), jnp.zeros(tuple(scale_shape), jnp.float32), rotated=rotated)


def store(x: jax.Array, like: Any) -> Any:
    """``x [..., heads, head_dim]`` as a cache block like `like` holds it: as it is for a plain array,
    or rotated (when `like` is) and encoded, the scales given a size-1 head_dim axis."""
    if not isinstance(like, Quantized):
        return x
    codes, scales = encode(rotate(x) if like.rotated else x, like.quantized)
    return Quantized(codes, scales[..., None], rotated=like.rotated)
