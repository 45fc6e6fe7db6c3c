"""Classifier-free guidance (Ho & Salimans 2022), with an interval and rescaling."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class CFG:
    """Classifier-free guidance on the denoised estimate: D = D_u + scale (D_c - D_u).

    ``denoise(x, sigma)`` gives D_c (the bound conditions) and ``denoise(x, sigma, null)`` gives D_u;
    ``null`` defaults to ``{}``, every condition dropped (see dew.diffusion.process for the backbone
    convention). scale = 1 is the conditional model, scale = 0 the unconditional one. Because
    eps = (x - D) / sigma is affine in D, guiding D is the same as guiding eps.

    ``interval=(lo, hi)`` applies guidance only at noise levels whose position on the grid lies in
    [lo, hi] (Kynkäänniemi et al. 2024), elsewhere D = D_c and the unconditional call is skipped.
    Position is measured on a log-sigma scale over the grid's noise range:
    u(sigma) = log(sigma_max / sigma) / log(sigma_max / sigma_min), with sigma_max the grid's first
    level and sigma_min its last nonzero one, clipped to [0, 1]: 0 is the start of sampling (most
    noise), 1 the end. (0, 1) guides everywhere. EDM2's sigma in (0.28, 5.42] on the 0.002..80 grid
    is roughly interval=(0.25, 0.53).

    ``rescale`` (phi) is Lin et al. (2023, "Common diffusion noise schedules and sample steps are
    flawed", eqs. 15-17), applied to the denoised estimate: D_r = D * std(D_c) / std(D) per example,
    then phi D_r + (1 - phi) D. rescale = 0 leaves D unchanged.
    """

    scale: float
    interval: tuple[float, float] = (0.0, 1.0)
    rescale: float = 0.0
    null: Any = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        lo, hi = self.interval
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"CFG interval must satisfy 0 <= lo <= hi <= 1 (positions on the noise "
                             f"range, 0 = most noise), got {self.interval}")
        if not 0.0 <= self.rescale <= 1.0:
            raise ValueError(f"CFG rescale must be in [0, 1], got {self.rescale}")

    def combine(self, cond, uncond):
        guided = uncond + self.scale * (cond - uncond)
        if self.rescale:
            axes = tuple(range(1, cond.ndim))
            factor = jnp.std(cond, axis=axes, keepdims=True) / jnp.std(guided, axis=axes, keepdims=True)
            guided = self.rescale * guided * factor + (1.0 - self.rescale) * guided
        return guided

    def position(self, sigma, sigmas):
        """Where sigma lies on the grid's noise range, 0 (start) .. 1 (end), log scale."""
        hi = sigmas[0]
        lo = jnp.min(jnp.where(sigmas > 0, sigmas, jnp.inf))
        span = jnp.log(hi) - jnp.log(lo)
        u = (jnp.log(hi) - jnp.log(jnp.maximum(sigma, 1e-30))) / jnp.where(span > 0, span, 1.0)
        return jnp.clip(u, 0.0, 1.0)

    def bind(self, denoise, sigmas):
        """The guided denoiser for a sampling run over ``sigmas``."""
        lo, hi = self.interval
        eps = 1e-6

        def guided(x, sigma):
            cond = denoise(x, sigma)
            if (lo, hi) == (0.0, 1.0):
                return self.combine(cond, denoise(x, sigma, self.null))
            u = self.position(jnp.max(jnp.asarray(sigma)), sigmas)
            active = (u >= lo - eps) & (u <= hi + eps)
            return lax.cond(active, lambda _: self.combine(cond, denoise(x, sigma, self.null)),
                            lambda _: cond, None)
        return guided

    def tree_flatten(self):
        return (self.null,), (self.scale, self.interval, self.rescale)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        for name, value in zip(("scale", "interval", "rescale", "null"), aux + children):
            object.__setattr__(obj, name, value)
        return obj
