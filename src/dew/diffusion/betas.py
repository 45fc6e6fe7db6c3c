"""Discrete DDPM noise tables: betas over N training timesteps and the sigma-space levels they give.

A discrete-time model is trained at timesteps n = 0 .. N-1 with ``alpha_bar[n] = prod(1 - beta[:n+1])``;
its sigma-space noise level is ``sqrt((1 - alpha_bar) / alpha_bar)``. The tables follow the
constructions diffusers' schedulers use (float32, like theirs): ``linear`` (Ho et al. 2020),
``scaled_linear`` (linear in sqrt(beta), Stable Diffusion's) and ``squaredcos_cap_v2`` (the cosine
alpha_bar of Nichol & Dhariwal 2021, betas capped at 0.999), with the zero-terminal-SNR rescaling of
Lin et al. (2023) on top.
"""

from __future__ import annotations

import math

import numpy as np

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")


def betas(schedule: str, timesteps: int, beta_start: float, beta_end: float) -> np.ndarray:
    """The float32 betas of a named schedule over ``timesteps`` training steps."""
    if schedule == "linear":
        return np.linspace(beta_start, beta_end, timesteps, dtype=np.float32)
    if schedule == "scaled_linear":
        return np.linspace(beta_start**0.5, beta_end**0.5, timesteps, dtype=np.float32) ** 2
    if schedule == "squaredcos_cap_v2":
        def alpha_bar(t):
            return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
        return np.array([min(1 - alpha_bar((i + 1) / timesteps) / alpha_bar(i / timesteps), 0.999)
                         for i in range(timesteps)], np.float32)
    raise ValueError(f"beta_schedule {schedule!r} is not one Dew builds; it builds {', '.join(BETA_SCHEDULES)}")


def rescale_zero_terminal_snr(betas: np.ndarray) -> np.ndarray:
    """Shift and scale sqrt(alpha_bar) so the last timestep has zero SNR and the first keeps its
    value (Lin et al. 2023, Algorithm 1)."""
    root = np.sqrt(np.cumprod(1.0 - betas, dtype=np.float32))
    first, last = root[0], root[-1]
    root = (root - last) * (first / (first - last))
    alpha_bar = root**2
    return (1.0 - np.concatenate([alpha_bar[:1], alpha_bar[1:] / alpha_bar[:-1]])).astype(np.float32)


def alphas_cumprod(betas: np.ndarray, *, zero_terminal_snr: bool = False) -> np.ndarray:
    """alpha_bar[n] in float32. With a zero-SNR table the last entry is set to 2^-24 rather than 0,
    so its noise level (4096) stays finite, as diffusers' Euler and DPM-Solver schedulers do."""
    table = np.cumprod(1.0 - np.asarray(betas, np.float32), dtype=np.float32)
    if zero_terminal_snr:
        table[-1] = 2.0**-24
    return table


def noise_levels(alpha_bar: np.ndarray) -> np.ndarray:
    """The sigma-space level of each training timestep, ascending with n."""
    return np.sqrt((1.0 - alpha_bar) / alpha_bar).astype(np.float32)
