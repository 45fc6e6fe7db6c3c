"""Noise schedules: pure functions of the diffusion time t in [0, 1].

Every schedule describes a forward process ``x_t = alpha(t) * x0 + sigma(t) * eps`` with t = 0 the
data and t = 1 the noisiest level. Three families exist:

- ``"vp"`` (variance preserving, alpha^2 + sigma^2 = 1): `LinearSchedule` (DDPM betas),
  `CosineSchedule`, `SqrtSchedule`;
- ``"ve"`` (variance exploding, alpha = 1): `KarrasSchedule`, `ExponentialSchedule`;
- ``"flow"`` (rectified flow, alpha = 1 - t, sigma = t): `FlowSchedule`.

Solvers work in k-diffusion's sigma space, where ``x = x0 + s * eps``. Any schedule maps there by
dividing by alpha: ``x_s = x_t / alpha(t)`` and ``s = noise_level(t) = sigma(t) / alpha(t)``
(``exp(-log_snr / 2)``). ``time(s)`` inverts ``noise_level``, and ``grid(steps)`` gives the
descending noise levels a sampler visits, ending with 0. The first level of every grid is
``sigma_max`` whatever the step count, so `Process.noise` can draw x_T before the step count is known.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from dew.checks import count


def karras_sigmas(steps: int, sigma_min: float, sigma_max: float, rho: float = 7.0):
    """The grid of Karras et al. (2022), eq. 5: uniform in sigma^(1/rho), then a final 0."""
    ramp = jnp.linspace(0.0, 1.0, steps)
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return jnp.append((hi + ramp * (lo - hi)) ** rho, 0.0)


def exponential_sigmas(steps: int, sigma_min: float, sigma_max: float):
    """A grid uniform in log sigma (uniform in log-SNR), then a final 0."""
    return jnp.append(jnp.exp(jnp.linspace(math.log(sigma_max), math.log(sigma_min), steps)), 0.0)


class Schedule:
    """Base class: subclasses define `alpha`, `sigma`, `time` and the grid's range."""

    kind: str = ""
    sigma_min: float
    sigma_max: float

    def alpha(self, t):
        raise NotImplementedError

    def sigma(self, t):
        raise NotImplementedError

    def time(self, noise_level):
        """The t whose ``noise_level(t)`` equals the given sigma-space noise level."""
        raise NotImplementedError

    def noise_level(self, t):
        """The sigma-space noise level ``sigma(t) / alpha(t)``."""
        return self.sigma(t) / self.alpha(t)

    def log_snr(self, t):
        """log(alpha^2 / sigma^2)."""
        return 2.0 * (jnp.log(self.alpha(t)) - jnp.log(self.sigma(t)))

    def grid(self, steps: int):
        """``steps + 1`` descending sigma-space noise levels, uniform in t, ending with 0."""
        steps = count(steps, "steps")
        t_hi, t_lo = self.time(jnp.float32(self.sigma_max)), self.time(jnp.float32(self.sigma_min))
        levels = self.noise_level(jnp.linspace(t_hi, t_lo, steps))
        levels = levels.at[-1].set(self.sigma_min).at[0].set(self.sigma_max)  # exact ends
        return jnp.append(levels, 0.0)


# ---------------------------------------------------------------- variance preserving


@dataclasses.dataclass(frozen=True)
class LinearSchedule(Schedule):
    """DDPM's discrete schedule (Ho et al. 2020): betas linear from beta_start to beta_end over
    `timesteps` steps, alpha_bar = cumprod(1 - beta). Timestep n sits at t = n / (timesteps - 1);
    between timesteps log sigma is interpolated (as diffusers does for fractional timesteps).
    The grid picks `steps` timesteps evenly from the last to the first, so it has at most
    `timesteps` levels: asking for more raises."""

    beta_start: float = 1e-4
    beta_end: float = 0.02
    timesteps: int = 1000
    kind = "vp"

    def _levels(self):
        betas = np.linspace(self.beta_start, self.beta_end, self.timesteps, dtype=np.float64)
        alpha_bar = np.cumprod(1.0 - betas)
        return np.sqrt((1.0 - alpha_bar) / alpha_bar)

    @property
    def sigma_min(self):
        return float(self._levels()[0])

    @property
    def sigma_max(self):
        return float(self._levels()[-1])

    def noise_level(self, t):
        log_levels = jnp.asarray(np.log(self._levels()), jnp.float32)
        n = jnp.asarray(t) * (self.timesteps - 1)
        return jnp.exp(jnp.interp(n, jnp.arange(self.timesteps, dtype=jnp.float32), log_levels))

    def alpha(self, t):
        return 1.0 / jnp.sqrt(1.0 + self.noise_level(t) ** 2)

    def sigma(self, t):
        s = self.noise_level(t)
        return s / jnp.sqrt(1.0 + s**2)

    def time(self, noise_level):
        log_levels = jnp.asarray(np.log(self._levels()), jnp.float32)
        n = jnp.interp(jnp.log(noise_level), log_levels, jnp.arange(self.timesteps, dtype=jnp.float32))
        return n / (self.timesteps - 1)

    def grid(self, steps: int):
        steps = count(steps, "steps")
        if steps > self.timesteps:
            raise ValueError(
                f"LinearSchedule has {self.timesteps} discrete timesteps, so a grid of {steps} steps "
                f"does not exist; use at most {self.timesteps} steps")
        picks = np.linspace(self.timesteps - 1, 0, steps).round().astype(int)
        return jnp.append(jnp.asarray(self._levels()[picks], jnp.float32), 0.0)


@dataclasses.dataclass(frozen=True)
class CosineSchedule(Schedule):
    """The cosine schedule of Nichol & Dhariwal (2021): alpha(t) = cos(phi(t)) / cos(phi(0)) with
    phi(t) = (t + s) / (1 + s) * pi / 2. alpha reaches 0 at t = 1, so the grid starts at
    `sigma_max` (t just below 1)."""

    s: float = 0.008
    sigma_min: float = 0.002
    sigma_max: float = 80.0
    kind = "vp"

    def _phi(self, t):
        return (t + self.s) / (1.0 + self.s) * (math.pi / 2)

    def alpha(self, t):
        return jnp.cos(self._phi(t)) / math.cos(self._phi(0.0))

    def sigma(self, t):
        return jnp.sqrt(jnp.clip(1.0 - self.alpha(t) ** 2, 0.0, 1.0))

    def time(self, noise_level):
        alpha = 1.0 / jnp.sqrt(1.0 + noise_level**2)
        phi = jnp.arccos(alpha * math.cos(self._phi(0.0)))
        return phi / (math.pi / 2) * (1.0 + self.s) - self.s


@dataclasses.dataclass(frozen=True)
class SqrtSchedule(Schedule):
    """The sqrt schedule of Li et al. (2022, Diffusion-LM): alpha_bar(t) = 1 - sqrt(t + s). Noise
    rises fast near t = 0, which suits discrete data embedded in a continuous space."""

    s: float = 1e-4
    sigma_max: float = 100.0
    kind = "vp"

    @property
    def sigma_min(self):
        return float(math.sqrt(math.sqrt(self.s) / (1.0 - math.sqrt(self.s))))

    def _alpha_bar(self, t):
        return jnp.clip(1.0 - jnp.sqrt(t + self.s), 1e-12, 1.0)

    def alpha(self, t):
        return jnp.sqrt(self._alpha_bar(t))

    def sigma(self, t):
        return jnp.sqrt(1.0 - self._alpha_bar(t))

    def time(self, noise_level):
        alpha_bar = 1.0 / (1.0 + noise_level**2)
        return (1.0 - alpha_bar) ** 2 - self.s


# ---------------------------------------------------------------- variance exploding


@dataclasses.dataclass(frozen=True)
class KarrasSchedule(Schedule):
    """EDM's schedule (Karras et al. 2022): alpha = 1 and sigma(t) runs from sigma_min at t = 0
    to sigma_max at t = 1, uniform in sigma^(1/rho). Its grid is eq. 5 of the paper."""

    sigma_min: float = 0.002
    sigma_max: float = 80.0
    rho: float = 7.0
    kind = "ve"

    def alpha(self, t):
        return jnp.ones_like(jnp.asarray(t, jnp.float32))

    def sigma(self, t):
        lo, hi = self.sigma_min ** (1 / self.rho), self.sigma_max ** (1 / self.rho)
        return (lo + jnp.asarray(t) * (hi - lo)) ** self.rho

    def time(self, noise_level):
        lo, hi = self.sigma_min ** (1 / self.rho), self.sigma_max ** (1 / self.rho)
        return (noise_level ** (1 / self.rho) - lo) / (hi - lo)

    def grid(self, steps: int):
        steps = count(steps, "steps")
        return karras_sigmas(steps, self.sigma_min, self.sigma_max, self.rho)


@dataclasses.dataclass(frozen=True)
class ExponentialSchedule(Schedule):
    """alpha = 1 and log sigma linear in t between sigma_min and sigma_max (uniform in log-SNR)."""

    sigma_min: float = 0.002
    sigma_max: float = 80.0
    kind = "ve"

    def alpha(self, t):
        return jnp.ones_like(jnp.asarray(t, jnp.float32))

    def sigma(self, t):
        lo, hi = math.log(self.sigma_min), math.log(self.sigma_max)
        return jnp.exp(lo + jnp.asarray(t) * (hi - lo))

    def time(self, noise_level):
        lo, hi = math.log(self.sigma_min), math.log(self.sigma_max)
        return (jnp.log(noise_level) - lo) / (hi - lo)

    def grid(self, steps: int):
        steps = count(steps, "steps")
        return exponential_sigmas(steps, self.sigma_min, self.sigma_max)


# ---------------------------------------------------------------- rectified flow


@dataclasses.dataclass(frozen=True)
class FlowSchedule(Schedule):
    """Rectified flow (Liu et al. 2022; Lipman et al. 2022): x_t = (1 - t) x0 + t eps.

    In sigma space the noise level is t / (1 - t), infinite at t = 1, so the grid starts at
    ``t_max`` (default 0.999, sigma 999: x_T is pure noise up to 0.1% of x0). ``shift`` is the
    timestep shift of Esser et al. (2024), t -> shift t / (1 + (shift - 1) t), applied to the grid.
    """

    shift: float = 1.0
    t_min: float = 1e-3
    t_max: float = 0.999
    kind = "flow"

    @property
    def sigma_min(self):
        t = self._shifted(self.t_min)
        return t / (1.0 - t)

    @property
    def sigma_max(self):
        t = self._shifted(self.t_max)
        return t / (1.0 - t)

    def _shifted(self, t):
        return self.shift * t / (1.0 + (self.shift - 1.0) * t)

    def alpha(self, t):
        return 1.0 - jnp.asarray(t)

    def sigma(self, t):
        return jnp.asarray(t) * 1.0

    def time(self, noise_level):
        return noise_level / (1.0 + noise_level)

    def grid(self, steps: int):
        steps = count(steps, "steps")
        t = self._shifted(jnp.linspace(self.t_max, self.t_min, steps))
        levels = (t / (1.0 - t)).at[-1].set(self.sigma_min).at[0].set(self.sigma_max)
        return jnp.append(levels, 0.0)
