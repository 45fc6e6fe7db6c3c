"""Loss weightings over noise levels.

A weighting returns lambda, the weight on the squared error of the denoised x0 at a noise level,
as the papers state it. `Process` turns it into the weight on the transform's own target,
``lambda * x0_scale^2``, because an error e in the backbone output is an error x0_scale * e in x0.
SNR below is alpha^2 / sigma^2 = 1 / s^2 with s the sigma-space noise level.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ScheduleWeighting:
    """The weighting that belongs with the transform: uniform in the transform's target space
    (the "simple" loss of eps-, v-, x0- and flow-prediction), lambda = 1 / x0_scale^2. For
    `KarrasPreconditioning` that is EDM's lambda(s) = (s^2 + sd^2) / (s sd)^2 = 1 / c_out^2."""

    def __call__(self, t, schedule, transform):
        return 1.0 / transform.x0_scale(t, schedule) ** 2


@dataclasses.dataclass(frozen=True)
class P2Weighting:
    """Perception-prioritized weighting (Choi et al. 2022): the eps-space weight 1 / (k + SNR)^gamma,
    which is lambda = SNR / (k + SNR)^gamma on x0 errors. gamma = 0 recovers the eps "simple" loss."""

    gamma: float = 1.0
    k: float = 1.0

    def __call__(self, t, schedule, transform):
        s2 = schedule.noise_level(t) ** 2  # SNR / (k + SNR)^gamma, written to stay finite at s = 0
        return s2 ** (self.gamma - 1.0) / (self.k * s2 + 1.0) ** self.gamma


@dataclasses.dataclass(frozen=True)
class MinSNRWeighting:
    """Min-SNR-gamma (Hang et al. 2023): lambda = min(SNR, gamma), so low-noise levels stop
    dominating the loss. With eps-prediction this is min(SNR, gamma) / SNR, with v-prediction
    min(SNR, gamma) / (SNR + 1)."""

    gamma: float = 5.0

    def __call__(self, t, schedule, transform):
        snr = 1.0 / schedule.noise_level(t) ** 2
        return jnp.minimum(snr, self.gamma)
