"""Embeddings shared by the diffusion backbones: noise level, patches, positions, labels, conditions.

- `NoiseEmbedding`: a per-example real scalar (t in [0, 1], or EDM's c_noise = ln(sigma) / 4)
  -> sinusoidal features -> MLP, as DiT's TimestepEmbedder (Peebles & Xie 2023).
- `PatchEmbedding` / `unpatchify`: non-overlapping patches (2-D) or tubelets (3-D) <-> tokens.
- `sincos_positions`: fixed sine/cosine position tables over a 1-, 2- or 3-D grid (MAE / DiT).
- `LabelEmbedding`: class ids with a learned null row at index ``num_classes`` for
  classifier-free guidance.
- `ConditionVector`: the pooled conditioning vector of DiT / UNet / VideoDiT: noise embedding
  plus label embedding plus a projection of a pooled ``"embedding"``.
- `check_conditions`: the condition dict a model was built for, with a clear error otherwise.
- `text_tokens` / `masked_mean`: the "text" [B, T, D] token condition of the text-conditioned
  backbones (MMDiT, and SimpleDiT / UNet built with ``text_features``) with the tokens it may read;
  `PooledTextEmbedding` turns it into a vector for the pooled conditioning.

The condition convention (every backbone): ``conditions`` is a dict or None. ``"label"`` is int
[B]; an id < 0 or == num_classes is the null class, and a missing key makes every row null.
``"embedding"`` is float [B, D]; a missing key is the same as a zero row, so the rows that
condition dropout zeroes and a missing key give the same output. ``"text"`` is float [B, T, D]
token states; a token whose embedding is all zeros is padding, ``"text_mask"`` (bool [B, T])
marks further padding, and a missing key is one padding token (no text at all).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def dense(features, axes, name, *, dtype, param_dtype, use_bias=True, zero=False, init=None):
    """nn.Dense with a logically named kernel [in, out] (xavier-uniform, or zeros) and bias [out].

    The returned layer applies to tokens flattened to 2-D rows: the same parameters and values, but
    XLA's CPU backward pass then computes the weight gradient without transposing activations.
    """
    kernel_init = nn.initializers.zeros if zero else (init or nn.initializers.xavier_uniform())
    layer = nn.Dense(
        features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nn.with_logical_partitioning(kernel_init, axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[-1:]),
        name=name,
    )

    def apply(x):
        if x.ndim <= 2:
            return layer(x)
        return layer(x.reshape(-1, x.shape[-1])).reshape(x.shape[:-1] + (features,))

    return apply


# ------------------------------------------------------------------ noise level


def sinusoidal_features(values: jax.Array, features: int, max_period: float = 10000.0) -> jax.Array:
    """[B] reals -> [B, features]: cos then sin of ``values * max_period^(-i / half)``.

    Frequencies run from 1 down to 1 / max_period (GLIDE / DiT); an odd ``features`` pads a zero.
    """
    half = features // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    args = values.astype(jnp.float32)[:, None] * freqs[None, :]
    out = jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)
    if features % 2:
        out = jnp.pad(out, ((0, 0), (0, 1)))
    return out


class NoiseEmbedding(nn.Module):
    """noise_input [B] -> [B, features]: sinusoidal features of ``scale * noise_input`` -> MLP.

    ``scale=1000`` spreads t in [0, 1] (and c_noise, about [-1.5, 1.5]) over the sinusoid's
    frequencies the way DiT's integer timesteps 0..999 do.
    """

    features: int
    frequency_features: int = 256
    scale: float = 1000.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, noise_input: jax.Array) -> jax.Array:
        freq = sinusoidal_features(self.scale * noise_input.astype(jnp.float32), self.frequency_features)
        init = nn.initializers.normal(0.02)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype, init=init)
        h = dense(self.features, (None, "embed"), "dense_0", **kw)(freq.astype(self.dtype))
        return dense(self.features, ("embed", "mlp"), "dense_1", **kw)(nn.silu(h))


# ------------------------------------------------------------------ patches


class PatchEmbedding(nn.Module):
    """[B, *grid*patch, C] -> [B, *grid, features]: a strided conv, one token per patch.

    ``patch_shape`` is (p, p) for images or (tubelet, p, p) for clips. The kernel is initialized
    like a dense layer on the flattened patch (DiT), xavier-uniform over [prod(patch)*C, features].
    """

    features: int
    patch_shape: Sequence[int]
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        patch = tuple(self.patch_shape)
        axes = (None,) * (len(patch) + 1) + ("embed",)
        init = nn.initializers.xavier_uniform(in_axis=tuple(range(len(patch) + 1)), out_axis=-1)
        return nn.Conv(
            self.features,
            kernel_size=patch,
            strides=patch,
            padding="VALID",
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=nn.with_logical_partitioning(init, axes),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            name="proj",
        )(x)


def unpatchify(tokens: jax.Array, grid: Sequence[int], patch_shape: Sequence[int], channels: int) -> jax.Array:
    """[B, prod(grid), prod(patch)*C] -> [B, *(grid*patch), C]: the inverse of patching.

    Token n is grid cell n in row-major order; its features are the patch's pixels in row-major
    order, channels last.
    """
    grid, patch = tuple(grid), tuple(patch_shape)
    n = len(grid)
    x = tokens.reshape(tokens.shape[0], *grid, *patch, channels)
    # interleave grid and patch axes: (g0, p0, g1, p1, ...)
    order = [0] + [a for i in range(n) for a in (1 + i, 1 + n + i)] + [1 + 2 * n]
    x = x.transpose(order)
    return x.reshape(tokens.shape[0], *(g * p for g, p in zip(grid, patch)), channels)


def check_patch_grid(
    shape: Sequence[int], patch_shape: Sequence[int], names: Sequence[str], model: str
) -> tuple[int, ...]:
    """The token grid of an input with spatial ``shape``; a ValueError when a side does not divide."""
    grid = []
    for size, patch, name in zip(shape, patch_shape, names):
        if size % patch:
            raise ValueError(
                f"{model}: input {name} {size} is not divisible by its patch size {patch}; "
                f"resize or crop the input to a multiple of {patch}, or build the model with a "
                f"patch size that divides {size}"
            )
        grid.append(size // patch)
    return tuple(grid)


# ------------------------------------------------------------------ positions


def sincos_positions(features: int, grid: Sequence[int], max_period: float = 10000.0) -> np.ndarray:
    """Fixed [prod(grid), features] sine/cosine positions over a row-major grid (MAE, DiT).

    Each grid axis gets an equal, even share ``2 * (features // (2 * len(grid)))`` of the features
    (sin then cos of ``position * max_period^(-i / quarter)``), axes in order; a remainder is
    zero. A 2-D grid with features % 4 == 0 splits exactly in half: rows, then columns.
    """
    grid = tuple(int(g) for g in grid)
    share = 2 * (features // (2 * len(grid)))
    coords = np.meshgrid(*[np.arange(g, dtype=np.float64) for g in grid], indexing="ij")
    parts = []
    for c in coords:
        omega = 1.0 / max_period ** (np.arange(share // 2, dtype=np.float64) / max(share // 2, 1))
        angles = c.reshape(-1)[:, None] * omega[None, :]
        parts.append(np.concatenate([np.sin(angles), np.cos(angles)], axis=1))
    table = np.concatenate(parts, axis=1)
    table = np.pad(table, ((0, 0), (0, features - table.shape[1])))
    return table.astype(np.float32)


# ------------------------------------------------------------------ labels and conditions


def check_labels(labels: Any, num_classes: int, model: str) -> None:
    """Eager range check of concrete label ids: valid are [0, num_classes), null is < 0 or ==
    num_classes; an id above num_classes raises. Traced ids (under jit) pass unchecked."""
    if isinstance(labels, jax.core.Tracer):
        return
    ids = np.asarray(labels)
    if ids.ndim != 1:
        raise ValueError(f"{model}: condition 'label' must be int [batch]; got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{model}: condition 'label' must hold integer class ids; got dtype {ids.dtype}")
    bad = np.flatnonzero(ids > num_classes)
    if bad.size:
        raise ValueError(
            f"{model}: label {int(ids[bad[0]])} at row {int(bad[0])} is out of range for "
            f"num_classes={num_classes}; use ids in [0, {num_classes}) and -1 (or {num_classes}) "
            f"for 'no label'"
        )


class LabelEmbedding(nn.Module):
    """int [B] -> [B, features], with a learned null row at index ``num_classes``.

    Ids < 0 or >= num_classes select the null row (under jit an id above num_classes cannot be
    checked, so it is clamped to the null row; `check_labels` rejects it eagerly).
    """

    num_classes: int
    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, labels: jax.Array) -> jax.Array:
        table = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, "embed")),
            (self.num_classes + 1, self.features),
            self.param_dtype,
        )
        labels = jnp.asarray(labels).astype(jnp.int32)
        ids = jnp.where((labels < 0) | (labels >= self.num_classes), self.num_classes, labels)
        return jnp.take(jnp.asarray(table, self.dtype), ids, axis=0)


def check_conditions(conditions: Mapping[str, Any] | None, accepted: Mapping[str, str], model: str) -> dict:
    """``conditions`` as a dict, or a ValueError naming a key the model was not built for.

    ``accepted`` maps each key the model takes to a short description of it.
    """
    if conditions is None:
        return {}
    if not isinstance(conditions, Mapping):
        raise ValueError(f"{model}: conditions must be a dict (or None); got {type(conditions).__name__}")
    for key in conditions:
        if key not in accepted:
            takes = (
                "; ".join(f"{k!r} ({v})" for k, v in accepted.items()) if accepted
                else "no conditions (it was built unconditional)"
            )
            raise ValueError(
                f"{model} got condition {key!r}, which it was not built for; it accepts {takes}. "
                f"Build the model with that condition (e.g. num_classes=... for 'label', "
                f"condition_features=... for 'embedding'), or leave the key out"
            )
    return dict(conditions)


def pooled_condition_keys(num_classes: int | None, condition_features: int | None) -> dict[str, str]:
    """The condition keys a `ConditionVector` with these settings accepts, with descriptions."""
    keys = {}
    if num_classes is not None:
        keys["label"] = f"int [batch] class ids in [0, {num_classes}), -1 for none"
    if condition_features is not None:
        keys["embedding"] = f"float [batch, {condition_features}] pooled embedding, zeros for none"
    return keys


class ConditionVector(nn.Module):
    """The pooled conditioning vector c [B, features] = noise + label + embedding projection.

    Submodules: ``noise_embed`` (`NoiseEmbedding`), ``label_embed`` (`LabelEmbedding`, when
    num_classes is set), ``condition_embed`` (Dense of the ``"embedding"`` condition, when
    condition_features is set; a missing key projects a zero row).
    """

    features: int
    num_classes: int | None = None
    condition_features: int | None = None
    noise_scale: float = 1000.0
    model: str = "model"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, noise_input: jax.Array, conditions: Mapping[str, Any], batch: int) -> jax.Array:
        labels, emb = self._inputs(conditions, batch)
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        noise_input = jnp.broadcast_to(jnp.asarray(noise_input, jnp.float32), (batch,))
        c = NoiseEmbedding(self.features, scale=self.noise_scale, name="noise_embed", **kw)(noise_input)
        if labels is not None:
            c = c + LabelEmbedding(self.num_classes, self.features, name="label_embed", **kw)(labels)
        if emb is not None:
            c = c + dense(self.features, (None, "embed"), "condition_embed", **kw)(jnp.asarray(emb, self.dtype))
        return c

    def _inputs(self, conditions, batch):
        """(labels [B] or None, embedding [B, D] or None), checked; missing keys become null rows."""
        labels = emb = None
        if self.num_classes is not None:
            labels = conditions.get("label")
            if labels is None:
                labels = jnp.full((batch,), -1, jnp.int32)
            else:
                check_labels(labels, self.num_classes, self.model)
                if tuple(jnp.shape(labels)) != (batch,):
                    raise ValueError(
                        f"{self.model}: condition 'label' must be [{batch}] (one id per example); "
                        f"got {tuple(jnp.shape(labels))}"
                    )
        if self.condition_features is not None:
            emb = conditions.get("embedding")
            if emb is None:
                emb = jnp.zeros((batch, self.condition_features), self.dtype)
            elif tuple(jnp.shape(emb)) != (batch, self.condition_features):
                raise ValueError(
                    f"{self.model}: condition 'embedding' must be [{batch}, {self.condition_features}] "
                    f"(condition_features={self.condition_features}); got {tuple(jnp.shape(emb))}"
                )
        return labels, emb


def text_condition_keys(text_features: int) -> dict[str, str]:
    """The condition keys of a backbone that reads text tokens, with descriptions."""
    return {
        "text": f"float [batch, tokens, {text_features}] token embeddings, zeros for none",
        "text_mask": "bool [batch, tokens], False for padding tokens",
    }


def text_tokens(conditions: Mapping[str, Any], batch: int, text_features: int, dtype: Any,
                model: str) -> tuple[jax.Array, jax.Array]:
    """(text [B, T, text_features], valid [B, T]) from the conditions; a missing "text" is one padding
    token. A token is valid when its embedding is not all zeros and "text_mask" (if given) is True."""
    if conditions.get("text") is None:
        text = jnp.zeros((batch, 1, text_features), dtype)
    else:
        text = jnp.asarray(conditions["text"])
    if len(text.shape) != 3 or text.shape[0] != batch or text.shape[2] != text_features:
        raise ValueError(
            f"{model}: condition 'text' must be [{batch}, tokens, {text_features}] "
            f"(text_features={text_features}); got {tuple(text.shape)}"
        )
    valid = jnp.any(text != 0, axis=-1)
    mask = conditions.get("text_mask")
    if mask is not None:
        if tuple(jnp.shape(mask)) != tuple(text.shape[:2]):
            raise ValueError(
                f"{model}: 'text_mask' must be [{batch}, {text.shape[1]}] like 'text'; "
                f"got {tuple(jnp.shape(mask))}"
            )
        valid = valid & jnp.asarray(mask, bool)
    return text, valid


def masked_mean(tokens: jax.Array, valid: jax.Array) -> jax.Array:
    """The mean over axis 1 of tokens [B, T, D] where valid [B, T]; zeros for a row with none."""
    weights = valid.astype(tokens.dtype)[..., None]
    return jnp.sum(tokens * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1)


class PooledTextEmbedding(nn.Module):
    """text [B, T, D] and valid [B, T] -> [B, features]: the mean of the valid tokens -> Dense ->
    SiLU -> Dense. The last Dense starts at zero, so adding it to a conditioning vector starts as
    a no-op (a fresh text-conditioned DiT or UNet begins like the unconditioned one)."""

    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, text: jax.Array, valid: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h = dense(self.features, (None, "embed"), "dense_0", **kw)(masked_mean(text.astype(self.dtype), valid))
        return dense(self.features, ("embed", "mlp"), "dense_1", zero=True, **kw)(nn.silu(h))


def check_channels(module: nn.Module, channels: int, path: Sequence[str], axis: int, model: str) -> None:
    """After init, raise a ValueError when the input's channels differ from those the params hold.

    ``path`` leads from the module's params to a kernel whose ``axis`` is the input channels.
    """
    if module.is_initializing() or not module.has_variable("params", path[0]):
        return
    leaf = module.variables["params"]
    for name in path:
        leaf = leaf[name]
    leaf = getattr(leaf, "value", leaf)  # a logically partitioned box
    expected = int(np.shape(leaf)[axis])
    if channels != expected:
        raise ValueError(
            f"{model}: input has {channels} channels, but the parameters were initialized for "
            f"{expected}; re-initialize the model with {channels}-channel inputs or feed "
            f"{expected}-channel inputs"
        )
