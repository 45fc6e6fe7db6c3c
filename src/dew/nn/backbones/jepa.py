"""The I-JEPA / V-JEPA encoder and predictor (Assran et al. 2023, arXiv:2301.08243; Bardes et al.
2024, arXiv:2404.08471).

JepaEncoder: a plain ViT over patch tokens.
    image [B, H, W, C]      -> patches of patch_size x patch_size     -> tokens [B, N, D]
    clip  [B, T, H, W, C]   -> tubelets of tubelet_size x p x p       -> tokens [B, N, D]
    tokens + fixed sin-cos positions -> (keep only the tokens in `keep`) -> num_layers x Block -> LayerNorm

JepaPredictor: a narrower ViT that reads the context encoder's tokens and one mask token per target
position (a learned vector plus that position's sin-cos embedding) and predicts the target
encoder's representation at each target position. Each target block is predicted in its own pass
over the context, as in I-JEPA.

Token order is raster order over the token grid (time, then rows, then columns), so token
`t * Hp * Wp + i * Wp + j` is patch (i, j) of tubelet t. Index sets (`keep`, mask indices) use
this order. Every parameter carries logical axis names for sharding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.checks import count, count_fields
from dew.nn.attention import check_attention_impl, dot_product_attention

INIT_STD = 0.02  # truncated N(0, 0.02) for every weight, as in I-JEPA's _init_weights


def sincos_positions(grid: Sequence[int], features: int) -> np.ndarray:
    """Fixed sin-cos position embeddings `[prod(grid), features]` for a token grid (MAE/I-JEPA).

    Each grid axis gets an equal, even share of the features: half sines, half cosines of the
    coordinate times frequencies 1 / 10000^(i / half). Features left over (when `features` is not
    a multiple of 2 * len(grid)) are zero.
    """
    grid = tuple(int(g) for g in grid)
    share = 2 * (features // (2 * len(grid)))
    if share == 0:
        raise ValueError(
            f"sin-cos positions need at least 2 features per grid axis; got {features} features "
            f"for a {len(grid)}-axis grid."
        )
    coords = np.stack(np.meshgrid(*[np.arange(g, dtype=np.float64) for g in grid], indexing="ij"), -1)
    coords = coords.reshape(-1, len(grid))  # raster order: the last axis varies fastest
    half = share // 2
    omega = 1.0 / 10000 ** (np.arange(half, dtype=np.float64) / half)
    parts = []
    for axis in range(len(grid)):
        angles = coords[:, axis : axis + 1] * omega[None, :]
        parts += [np.sin(angles), np.cos(angles)]
    table = np.concatenate(parts, axis=-1)
    table = np.pad(table, ((0, 0), (0, features - table.shape[1])))
    return table.astype(np.float32)


def token_grid(shape: Sequence[int], patch_size: int, tubelet_size: int | None = None) -> tuple[int, ...]:
    """The token grid of one example: (H/p, W/p) for an image [H, W, C], (T/t, H/p, W/p) for a clip.

    Raises a ValueError naming the axis that does not divide.
    """
    shape = tuple(shape)
    video = tubelet_size is not None
    want = 4 if video else 3
    if len(shape) != want:
        layout = "[T, H, W, C] (a video clip)" if video else "[H, W, C] (an image)"
        raise ValueError(
            f"The encoder expects one example of shape {layout}; got {shape}. "
            + ("Pass tubelet_size=None for images." if video else "Pass tubelet_size=... for video clips.")
        )
    sizes = ((("frames", shape[0], tubelet_size),) if video else ()) + (
        ("height", shape[-3], patch_size),
        ("width", shape[-2], patch_size),
    )
    for name, size, step in sizes:
        if size % step:
            what = "tubelet_size" if name == "frames" else "patch_size"
            raise ValueError(
                f"The example's {name} ({size}) is not a multiple of {what}={step}; resize or crop "
                f"the input to a multiple of {step}."
            )
    return tuple(size // step for _, size, step in sizes)


def patchify(x: jax.Array, patch_size: int, tubelet_size: int | None = None) -> jax.Array:
    """[B, H, W, C] -> [B, N, p*p*C], or [B, T, H, W, C] -> [B, N, t*p*p*C], in raster order."""
    p = patch_size
    if tubelet_size is None:
        b, h, w, c = x.shape
        x = x.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
        return x.reshape(b, (h // p) * (w // p), p * p * c)
    t = tubelet_size
    b, f, h, w, c = x.shape
    x = x.reshape(b, f // t, t, h // p, p, w // p, p, c).transpose(0, 1, 3, 5, 2, 4, 6, 7)
    return x.reshape(b, (f // t) * (h // p) * (w // p), t * p * p * c)


def gather_tokens(tokens: jax.Array, index: jax.Array) -> jax.Array:
    """tokens [B, N, D] at index [B, ...] -> [B, ..., D]."""
    flat = index.reshape(index.shape[0], -1)
    picked = jnp.take_along_axis(tokens, flat[..., None], axis=1)
    return picked.reshape(index.shape + tokens.shape[-1:])


def _dense(features, axes, name, *, std=INIT_STD, dtype, param_dtype):
    return nn.Dense(
        features,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nn.with_logical_partitioning(nn.initializers.truncated_normal(std), axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[-1:]),
        name=name,
    )


def _layer_norm(name, dtype, param_dtype):
    return nn.LayerNorm(
        epsilon=1e-6,
        dtype=dtype,
        param_dtype=param_dtype,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)),
        name=name,
    )


class Block(nn.Module):
    """Pre-norm ViT block: x + attn(norm1(x)), then x + mlp(norm2(x)); bidirectional attention.

    The output projections start at INIT_STD / sqrt(2 * depth), I-JEPA's rescale_blocks.
    """

    num_heads: int
    mlp_ratio: float = 4.0
    depth: int = 1  # this block's 1-based position, for the residual rescale
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, features = x.shape
        heads = self.num_heads
        head_dim = features // heads
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        out_std = INIT_STD / math.sqrt(2.0 * self.depth)

        h = _layer_norm("norm1", **dense)(x)
        q = _dense(features, ("embed", "heads"), "q_proj", **dense)(h).reshape(batch, length, heads, head_dim)
        k = _dense(features, ("embed", "heads"), "k_proj", **dense)(h).reshape(batch, length, heads, head_dim)
        v = _dense(features, ("embed", "heads"), "v_proj", **dense)(h).reshape(batch, length, heads, head_dim)
        attended = dot_product_attention(q, k, v, causal=False, impl=self.attention_impl)
        attended = attended.reshape(batch, length, features)
        x = x + _dense(features, ("heads", "embed"), "o_proj", std=out_std, **dense)(attended)

        h = _layer_norm("norm2", **dense)(x)
        hidden = int(features * self.mlp_ratio)
        h = nn.gelu(_dense(hidden, ("embed", "mlp"), "fc1", **dense)(h), approximate=False)
        return x + _dense(features, ("mlp", "embed"), "fc2", std=out_std, **dense)(h)


def _check_heads(features: int, heads: int, what: str) -> None:
    if features % heads:
        raise ValueError(f"{what} ({features}) must be a multiple of num_heads ({heads}).")


class JepaEncoder(nn.Module):
    """A ViT over patch tokens (images) or tubelet tokens (video clips, with `tubelet_size`).

    `__call__(x, keep=None)`: `x` is float [B, H, W, C] (or [B, T, H, W, C]) in [-1, 1]; `keep`
    [B, K] int indices selects which tokens the transformer sees (the context). Returns the final
    LayerNorm's output [B, N or K, emb_features].
    """

    patch_size: int
    emb_features: int
    num_layers: int
    num_heads: int
    tubelet_size: int | None = None
    mlp_ratio: float = 4.0
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        super().__post_init__()
        count_fields(self, patch_size=1, emb_features=1, num_layers=1, num_heads=1)
        tubelet_size = count(self.tubelet_size, "JepaEncoder.tubelet_size", optional=True)
        object.__setattr__(self, "tubelet_size", tubelet_size)
        _check_heads(self.emb_features, self.num_heads, "JepaEncoder emb_features")
        check_attention_impl(self.attention_impl)

    def grid(self, example_shape: Sequence[int]) -> tuple[int, ...]:
        """The token grid for one example of this shape (no batch axis)."""
        return token_grid(example_shape, self.patch_size, self.tubelet_size)

    @nn.compact
    def __call__(self, x: jax.Array, keep: jax.Array | None = None) -> jax.Array:
        grid = self.grid(x.shape[1:])
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        patches = patchify(x.astype(self.dtype), self.patch_size, self.tubelet_size)
        # a Dense over flattened patches is the strided convolution of the ViT patch embedding
        tokens = _dense(self.emb_features, ("patch", "embed"), "patch_embed", **dense)(patches)
        tokens = tokens + jnp.asarray(sincos_positions(grid, self.emb_features), self.dtype)
        if keep is not None:
            tokens = gather_tokens(tokens, keep)
        for layer in range(self.num_layers):
            tokens = Block(
                self.num_heads, self.mlp_ratio, layer + 1, self.attention_impl, name=f"blocks_{layer}", **dense
            )(tokens)
        return _layer_norm("norm", **dense)(tokens)


class JepaPredictor(nn.Module):
    """Predicts target representations from the context tokens and the target positions.

    `__call__(context, context_index, target_index)`: context [B, Nc, emb_features] from the
    context encoder, context_index [B, Nc] their token positions, target_index [B, M, Nt] the
    positions of M target blocks. Returns [B, M, Nt, emb_features]. `grid` is the encoder's token
    grid (for the positions).
    """

    grid: tuple[int, ...]
    emb_features: int
    predictor_features: int
    num_layers: int
    num_heads: int
    mlp_ratio: float = 4.0
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        if not self.grid:
            raise ValueError(f"JepaPredictor.grid must give a token count per axis; got {self.grid!r}.")
        object.__setattr__(self, "grid", tuple(count(g, "JepaPredictor.grid entry") for g in self.grid))
        super().__post_init__()
        count_fields(self, emb_features=1, predictor_features=1, num_layers=1, num_heads=1)
        _check_heads(self.predictor_features, self.num_heads, "JepaPredictor predictor_features")
        check_attention_impl(self.attention_impl)

    @nn.compact
    def __call__(self, context: jax.Array, context_index: jax.Array, target_index: jax.Array) -> jax.Array:
        batch, num_context, _ = context.shape
        _, num_targets, target_len = target_index.shape
        width = self.predictor_features
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        positions = jnp.asarray(sincos_positions(self.grid, width), self.dtype)

        x = _dense(width, ("embed", "embed_predictor"), "predictor_embed", **dense)(context.astype(self.dtype))
        x = x + positions[context_index]
        mask_token = self.param(
            "mask_token",
            nn.with_logical_partitioning(nn.initializers.truncated_normal(INIT_STD), ("embed_predictor",)),
            (width,),
            self.param_dtype,
        )
        queries = mask_token.astype(self.dtype) + positions[target_index]  # [B, M, Nt, width]

        # one pass per target block: the context repeated M times along the batch axis
        x = jnp.repeat(x, num_targets, axis=0)
        queries = queries.reshape(batch * num_targets, target_len, width)
        x = jnp.concatenate([x, queries], axis=1)
        for layer in range(self.num_layers):
            x = Block(
                self.num_heads, self.mlp_ratio, layer + 1, self.attention_impl, name=f"blocks_{layer}", **dense
            )(x)
        x = _layer_norm("predictor_norm", **dense)(x[:, num_context:])
        x = _dense(self.emb_features, ("embed_predictor", "embed"), "predictor_proj", **dense)(x)
        return x.reshape(batch, num_targets, target_len, self.emb_features)
