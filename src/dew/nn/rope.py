"""Rotary position embeddings (RoPE, Su et al. 2021, arXiv:2104.09864) in Hugging Face's layout.

The frequencies follow transformers' ``modeling_rope_utils`` for the rope types Dew supports
("default", "linear", "llama3", "yarn"), and the rotation is HF's ``rotate_half`` convention: the
head dimension is split into two halves ``(x1, x2)`` that rotate as pairs ``(x1[i], x2[i])``, not
as interleaved neighbours. Llama, Qwen and Mistral checkpoints therefore load without permuting
their q/k projection weights.

Frequencies are computed once, in NumPy (float64, stored as float32), from the configuration;
only ``positions * inv_freq`` and its cos/sin run on the device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type(scaling: Mapping[str, Any] | None) -> str:
    """The rope type named by an HF-style ``rope_scaling`` dict ("rope_type", or the older "type")."""
    if scaling is None:
        return "default"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported; use one of {ROPE_TYPES} (or None)"
        )
    return kind


def _require(scaling: Mapping[str, Any], kind: str, *keys: str) -> None:
    missing = [key for key in keys if scaling.get(key) is None]
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} needs {missing}; got {dict(scaling)}")


def default_inv_freq(dim: int, theta: float) -> np.ndarray:
    """theta ** (-2i / dim) for i < dim / 2: the original RoPE frequencies (float64)."""
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim
    return 1.0 / (theta**exponents)


def rope_frequencies(
    head_dim: int,
    theta: float = 10000.0,
    scaling: Mapping[str, Any] | None = None,
    max_position_embeddings: int = 2048,
) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``[head_dim // 2]`` (float32) and the cos/sin scale ("attention factor").

    ``scaling`` is an HF ``rope_scaling`` dict. ``max_position_embeddings`` is the model's context
    length, which YaRN uses when the dict has no "factor" or no "original_max_position_embeddings".
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    kind = rope_type(scaling)
    inv_freq = default_inv_freq(head_dim, theta)
    attention_factor = 1.0

    if kind == "linear":
        # positions divided by factor == frequencies divided by factor (Kaiokendev's interpolation)
        _require(scaling, kind, "factor")
        inv_freq = inv_freq / scaling["factor"]

    elif kind == "llama3":
        # Llama 3.1: long wavelengths are interpolated by `factor`, short ones are kept, and the
        # band between is blended linearly in 1 / wavelength.
        _require(scaling, kind, "factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings")
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context / low
        high_freq_wavelen = old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(medium, blended, scaled)

    elif kind == "yarn":
        # YaRN (Peng et al. 2023, arXiv:2309.00071): interpolate the low frequencies, extrapolate
        # the high ones, ramp between the dims that turn beta_fast and beta_slow times over the
        # original context, and scale cos/sin by the attention factor ("mscale").
        original = scaling.get("original_max_position_embeddings") or max_position_embeddings
        factor = scaling.get("factor")
        if factor is None:
            factor = max_position_embeddings / original
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # avoid dividing by zero in the ramp
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation_weight = 1 - ramp
        inv_freq = (inv_freq / factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight

    return inv_freq.astype(np.float32), float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_cos_sin(
    positions: jax.Array, inv_freq: np.ndarray, attention_factor: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``[..., head_dim]`` (float32) for integer positions ``[...]``.

    The angle for frequency i is ``position * inv_freq[i]``, repeated for both halves of the head
    (HF concatenates ``freqs`` with itself).
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def rotate_half(x: jax.Array) -> jax.Array:
    """(x1, x2) -> (-x2, x1) on the halves of the last axis."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [batch, len, heads, head_dim]`` by cos/sin ``[batch, len, head_dim]``.

    Like HF, cos/sin are cast to x's dtype first, so bf16 activations rotate in bf16.
    """
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    return x * cos + rotate_half(x) * sin
