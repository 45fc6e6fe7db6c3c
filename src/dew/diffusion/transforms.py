"""Prediction transforms: what the backbone predicts, and how that becomes a denoised x0.

A transform maps a backbone output at ``x_t = alpha(t) x0 + sigma(t) eps`` to the denoised estimate
of x0 (`denoised`), gives the training target the output is regressed on (`target`), and decides
what the backbone sees (`model_input`: the scaled input and the noise input, shaped [B]).
`x0_scale` is |d x0 / d output|, the factor between an error in the output and an error in x0,
which the weightings use to move a weight between the two spaces.

Compatibility (schedule kind -> transforms that fit it; anything else raises at `Process(...)`):

=====================  ====  ====  =====
transform              vp    ve    flow
=====================  ====  ====  =====
EpsilonPrediction      yes   yes   yes
X0Prediction           yes   yes   yes
VPrediction            yes   no    no     (v is defined for alpha^2 + sigma^2 = 1)
FlowPrediction         no    no    yes    (velocity of the straight path)
KarrasPreconditioning  no    yes   no     (EDM's c_in/c_skip/c_out assume x = x0 + sigma eps)
=====================  ====  ====  =====
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


def _expand(a, x):
    """Broadcast a per-example [B] (or scalar) array against x of shape [B, ...]."""
    a = jnp.asarray(a, x.dtype)
    return a.reshape(a.shape + (1,) * (x.ndim - a.ndim))


def _batch(a, x):
    """A noise input shaped [B]."""
    return jnp.broadcast_to(jnp.asarray(a, jnp.float32), x.shape[:1])


class Transform:
    """Base class. The default noise input is the schedule time t in [0, 1]."""

    kinds: tuple[str, ...] = ("vp", "ve", "flow")

    def check(self, schedule) -> None:
        if schedule.kind not in self.kinds:
            raise ValueError(
                f"{type(self).__name__} does not fit {type(schedule).__name__} (a {schedule.kind!r} "
                f"schedule); it works with {' or '.join(repr(k) for k in self.kinds)} schedules. "
                "See dew.diffusion.transforms for the compatibility table.")

    def model_input(self, x_t, t, schedule):
        return x_t, _batch(t, x_t)

    def denoised(self, output, x_t, t, schedule):
        raise NotImplementedError

    def target(self, x0, eps, t, schedule):
        raise NotImplementedError

    def x0_scale(self, t, schedule):
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class EpsilonPrediction(Transform):
    """The backbone predicts the noise eps (Ho et al. 2020): x0 = (x_t - sigma eps) / alpha."""

    def denoised(self, output, x_t, t, schedule):
        return (x_t - _expand(schedule.sigma(t), x_t) * output) / _expand(schedule.alpha(t), x_t)

    def target(self, x0, eps, t, schedule):
        return eps

    def x0_scale(self, t, schedule):
        return schedule.noise_level(t)


@dataclasses.dataclass(frozen=True)
class X0Prediction(Transform):
    """The backbone predicts the clean sample directly."""

    def denoised(self, output, x_t, t, schedule):
        return output

    def target(self, x0, eps, t, schedule):
        return x0

    def x0_scale(self, t, schedule):
        return jnp.ones_like(jnp.asarray(t, jnp.float32))


@dataclasses.dataclass(frozen=True)
class VPrediction(Transform):
    """The backbone predicts v = alpha eps - sigma x0 (Salimans & Ho 2022); x0 = alpha x_t - sigma v."""

    kinds = ("vp",)

    def denoised(self, output, x_t, t, schedule):
        return _expand(schedule.alpha(t), x_t) * x_t - _expand(schedule.sigma(t), x_t) * output

    def target(self, x0, eps, t, schedule):
        return _expand(schedule.alpha(t), x0) * eps - _expand(schedule.sigma(t), x0) * x0

    def x0_scale(self, t, schedule):
        return schedule.sigma(t)


@dataclasses.dataclass(frozen=True)
class FlowPrediction(Transform):
    """The backbone predicts the velocity of the straight path x_t = (1 - t) x0 + t eps.

    Convention: t = 0 is data and t = 1 is noise, so the velocity is dx_t/dt = eps - x0 (rectified
    flow's "x1 - x0" with x1 the noise), and x0 = x_t - t * velocity.
    """

    kinds = ("flow",)

    def denoised(self, output, x_t, t, schedule):
        return x_t - _expand(schedule.sigma(t), x_t) * output

    def target(self, x0, eps, t, schedule):
        return eps - x0

    def x0_scale(self, t, schedule):
        return schedule.sigma(t)


@dataclasses.dataclass(frozen=True)
class KarrasPreconditioning(Transform):
    """EDM's preconditioning (Karras et al. 2022, Table 1): D(x, s) = c_skip x + c_out F(c_in x, c_noise)
    with c_skip = sd^2 / (s^2 + sd^2), c_out = s sd / sqrt(s^2 + sd^2), c_in = 1 / sqrt(s^2 + sd^2),
    c_noise = ln(s) / 4, where sd is `sigma_data`, the data's standard deviation. The noise input is
    c_noise, not t."""

    sigma_data: float = 0.5
    kinds = ("ve",)

    def scalings(self, sigma):
        """(c_in, c_skip, c_out, c_noise) at the noise level sigma."""
        sigma = jnp.asarray(sigma, jnp.float32)
        sd2 = self.sigma_data**2
        total = sigma**2 + sd2
        return (1.0 / jnp.sqrt(total), sd2 / total, sigma * self.sigma_data / jnp.sqrt(total),
                jnp.log(sigma) / 4.0)

    def model_input(self, x_t, t, schedule):
        c_in, _, _, c_noise = self.scalings(schedule.sigma(t))
        return _expand(c_in, x_t) * x_t, _batch(c_noise, x_t)

    def denoised(self, output, x_t, t, schedule):
        _, c_skip, c_out, _ = self.scalings(schedule.sigma(t))
        return _expand(c_skip, x_t) * x_t + _expand(c_out, x_t) * output

    def target(self, x0, eps, t, schedule):
        sigma = schedule.sigma(t)
        _, c_skip, c_out, _ = self.scalings(sigma)
        x_t = x0 + _expand(sigma, x0) * eps
        return (x0 - _expand(c_skip, x0) * x_t) / _expand(c_out, x0)

    def x0_scale(self, t, schedule):
        return self.scalings(schedule.sigma(t))[2]
