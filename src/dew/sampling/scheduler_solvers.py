"""Solvers that take the exact steps of diffusers' schedulers, in sigma space.

Dew's general solvers (`dew.sampling.solvers`) already equal several schedulers' updates (Euler,
PNDM with skip_prk_steps, DDIM without clipping). The ones here add what a published scheduler
config can switch on and a plain solver cannot express:

- `FilteredDDIM`: DDIM (eta = 0) whose x0 estimate is clipped or dynamically thresholded while the
  noise estimate keeps the unclipped one, as DDIMScheduler.step does;
- `MultistepDPM`: DPMSolverMultistepScheduler's data- or noise-prediction multistep updates of
  order 1 to 3 with its order rules for the first and last steps (lower_order_final,
  euler_at_final, a final level of 0);
- `AncestralEuler`: EulerAncestralDiscreteScheduler's step, whose per-step noise can be given
  (`with_noises`) so a recorded sequence of draws replays exactly.

x0 filters (`ClipSample`, `DynamicThreshold`) act on the denoised estimate, which is the same
array in sigma space as in the scheduler's own space.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from dew.sampling.solvers import Solver, _safe, _scan


@dataclasses.dataclass(frozen=True)
class ClipSample:
    """Clamp x0 to [-limit, limit] (DDIM's clip_sample / clip_sample_range)."""

    limit: float = 1.0

    def __call__(self, x0):
        return jnp.clip(x0, -self.limit, self.limit)


@dataclasses.dataclass(frozen=True)
class DynamicThreshold:
    """Imagen's dynamic thresholding (Saharia et al. 2022): per sample, s is the `ratio` quantile of
    |x0| clamped to [1, max_value]; x0 is clamped to [-s, s] and divided by s."""

    ratio: float = 0.995
    max_value: float = 1.0

    def __call__(self, x0):
        flat = x0.reshape(x0.shape[0], -1)
        s = jnp.clip(jnp.quantile(jnp.abs(flat).astype(jnp.float32), self.ratio, axis=1), 1.0, self.max_value)
        s = s[:, None]
        return (jnp.clip(flat, -s, s) / s).reshape(x0.shape).astype(x0.dtype)


def _filtered(x0_filter, denoised):
    return denoised if x0_filter is None else x0_filter(denoised)


@dataclasses.dataclass(frozen=True)
class FilteredDDIM(Solver):
    """DDIM with eta = 0: x' = filter(D) + s' (x - D) / s. The noise estimate (x - D) / s is taken
    before the filter, so clipping moves only the x0 term (DDIMScheduler without
    use_clipped_model_output)."""

    x0_filter: Any = None

    def integrate(self, denoise, x, sigmas, key=None):
        def step(i, x, state, key):
            s, s_next = sigmas[i], sigmas[i + 1]
            denoised = denoise(x, s)
            return _filtered(self.x0_filter, denoised) + s_next * (x - denoised) / s, state
        return _scan(self, step, x, sigmas, key, ())


@dataclasses.dataclass(frozen=True)
class MultistepDPM(Solver):
    """DPM-Solver (Lu et al. 2022a) and DPM-Solver++ (Lu et al. 2022b) multistep, as
    DPMSolverMultistepScheduler steps them, with lambda = -log sigma in sigma space.

    ``data_prediction`` (dpmsolver++) extrapolates the filtered denoised outputs, otherwise the noise
    estimates (x - filter(D)) / s. Step i uses order 1 at i = 0, order <= 2 at i = 1, and lowers the
    order at the end: order 1 on the last step when ``euler_at_final``, or ``lower_order_final``
    with fewer than 15 steps, or the grid ends at 0 (``final_zero``); order <= 2 on the step before
    it under the same ``lower_order_final`` rule. ``heun`` picks the solver_type "heun"
    coefficients for order 2 instead of "midpoint".
    """

    order: int = 2
    data_prediction: bool = True
    heun: bool = False
    lower_order_final: bool = True
    euler_at_final: bool = False
    final_zero: bool = True
    x0_filter: Any = None

    def integrate(self, denoise, x, sigmas, key=None):
        if self.order not in (1, 2, 3):
            raise ValueError(f"MultistepDPM order must be 1, 2 or 3, got {self.order}")
        n = sigmas.shape[0] - 1
        short = self.lower_order_final and n < 15
        last_first_order = self.euler_at_final or short or self.final_zero

        def step(i, x, history, key):
            m1, m2 = history
            s, s_next = sigmas[i], sigmas[i + 1]
            denoised = _filtered(self.x0_filter, denoise(x, s))
            m0 = denoised if self.data_prediction else (x - denoised) / s
            lam = -jnp.log(sigmas[jnp.maximum(i - jnp.arange(3), 0)])
            h = jnp.log(s) - jnp.log(_safe(s_next))
            r0, r1 = (lam[0] - lam[1]) / h, (lam[1] - lam[2]) / h
            d1 = (m0 - m1) / r0
            d1_1 = (m1 - m2) / r1
            d1_3 = d1 + (r0 / (r0 + r1)) * (d1 - d1_1)
            d2 = (d1 - d1_1) / (r0 + r1)
            if self.data_prediction:
                phi1 = jnp.expm1(-h)
                first = (s_next / s) * x - phi1 * m0
                second = first + (((phi1 / h + 1.0) * d1) if self.heun else (-0.5 * phi1 * d1))
                third = first + (phi1 / h + 1.0) * d1_3 - ((phi1 + h) / h**2 - 0.5) * d2
            else:
                phi1 = jnp.expm1(h)
                first = x - s_next * phi1 * m0
                second = first - ((s_next * (phi1 / h - 1.0) * d1) if self.heun else (0.5 * s_next * phi1 * d1))
                third = first - s_next * (phi1 / h - 1.0) * d1_3 - s_next * ((phi1 - h) / h**2 - 0.5) * d2
            is_last, is_second_last = i == n - 1, i == n - 2
            order = jnp.where((self.order == 1) | (i == 0) | (is_last & last_first_order), 1,
                              jnp.where((self.order == 2) | (i == 1) | (is_second_last & short), 2, 3))
            x_next = jnp.where(order == 1, first, jnp.where(order == 2, second, third))
            x_next = jnp.where(s_next > 0, x_next, denoised)
            return x_next, (m0, m1)
        return _scan(self, step, x, sigmas, key, (jnp.zeros_like(x), jnp.zeros_like(x)))


@dataclasses.dataclass(frozen=True)
class AncestralEuler(Solver):
    """EulerAncestralDiscreteScheduler's step: Euler to sigma_down, then noise of size sigma_up with
    sigma_up^2 = s'^2 (s^2 - s'^2) / s^2 and sigma_down^2 = s'^2 - sigma_up^2. The draws for all
    steps come from the key at once, `[steps, *x.shape]`; `with_noises` takes them as given."""

    @property
    def stochastic(self) -> bool:
        return True

    def integrate(self, denoise, x, sigmas, key=None):
        self.check_key(key)
        noises = jax.random.normal(key, (sigmas.shape[0] - 1,) + x.shape, x.dtype)
        return self.with_noises(denoise, x, sigmas, noises)

    def with_noises(self, denoise, x, sigmas, noises):
        """Run with ``noises[i]`` as step i's draw; returns (x, index of the first non-finite step)."""

        def body(carry, inputs):
            x, bad = carry
            i, noise = inputs
            s, s_next = sigmas[i], sigmas[i + 1]
            up = jnp.sqrt(s_next**2 * (s**2 - s_next**2) / s**2)
            down = jnp.sqrt(s_next**2 - up**2)
            x = x + (x - denoise(x, s)) / s * (down - s) + noise * up
            bad = jnp.where((bad < 0) & ~jnp.all(jnp.isfinite(x)), i, bad).astype(jnp.int32)
            return (x, bad), None

        n = sigmas.shape[0] - 1
        (x, bad), _ = lax.scan(body, (x, jnp.int32(-1)), (jnp.arange(n), noises))
        return x, bad
