"""Where diffusers' ``denoising_end`` / ``denoising_start`` split a source scheduler's grid.

SDXL's base pipeline stops at ``denoising_end`` and its refiner (StableDiffusionXLImg2ImgPipeline)
resumes at ``denoising_start``: both cut the scheduler's timesteps at
``round(num_train_timesteps * (1 - fraction))``, the base keeping the timesteps at or above the
cut. `denoising_split` gives that count, the step index a Dew base run stops at
(``times=(0, split)``) and its refiner run starts at (``times=split``).
"""

from __future__ import annotations

import numpy as np

from dew.checks import count


def denoising_split(scheduler, steps: int, fraction: float) -> int:
    """The number of the ``steps``-step grid's steps at or above diffusers' cut for ``fraction``."""
    steps = count(steps, "steps")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction (diffusers' denoising_end / denoising_start) must be in (0, 1); got {fraction!r}.")
    train = scheduler.config.get("num_train_timesteps")
    if train is None:
        raise ValueError(f"{scheduler.class_name} has no num_train_timesteps; diffusers' split reads its timesteps.")
    cut = int(round(train - fraction * train))
    timesteps = np.round(np.asarray(scheduler.timesteps(scheduler.grid(steps)), np.float64), 3)
    split = int(np.sum(timesteps >= cut))
    if not 0 < split < steps:
        raise ValueError(f"fraction {fraction} cuts the {steps}-step grid at timestep {cut}, which leaves "
                         f"{split} steps to the first part; pick a fraction that leaves both parts a step.")
    return split
