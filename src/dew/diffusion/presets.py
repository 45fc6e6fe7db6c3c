"""Presets: the common (schedule, transform, weighting, training times, grid) combinations.

A preset is a small frozen dataclass of settings; calling it builds the `Process`
(``EDM(regime="pixel")()``). `as_process` accepts either, so objectives take both.
"""

from __future__ import annotations

import dataclasses
import math

from dew.diffusion.process import LogitNormalTimes, LogNormalSigmas, Process, UniformTimes
from dew.diffusion.schedules import (CosineSchedule, FlowSchedule, KarrasSchedule, SqrtSchedule)
from dew.diffusion.transforms import (EpsilonPrediction, FlowPrediction, KarrasPreconditioning,
                                      VPrediction, X0Prediction)
from dew.diffusion.weighting import ScheduleWeighting


def as_process(preset_or_process) -> Process:
    """A Process as is, or the Process a preset builds."""
    if isinstance(preset_or_process, Process):
        return preset_or_process
    process = preset_or_process()
    if not isinstance(process, Process):
        raise TypeError(f"expected a Process or a preset that builds one, got {preset_or_process!r}")
    return process


@dataclasses.dataclass(frozen=True)
class EDM:
    """EDM (Karras et al. 2022): Karras preconditioning and weighting, ln sigma ~ N(-1.2, 1.2^2)
    in training, the rho = 7 Karras grid from 0.002 to 80 for sampling.

    ``regime="pixel"`` is the paper's setting for images in [-1, 1] (sigma_data = 0.5).
    ``regime="latent"`` is for autoencoder latents scaled to unit variance (as SD's 0.18215 factor
    does): sigma_data = 1.0, and every noise level (the log-normal's mean and the grid's ends) is
    scaled by the same factor 2, so noise relative to the data is exactly the pixel regime's.
    ``sigma_data`` overrides the regime's value (noise levels then scale with it).
    """

    regime: str = "pixel"
    sigma_data: float | None = None
    rho: float = 7.0

    def __call__(self) -> Process:
        if self.regime not in ("pixel", "latent"):
            raise ValueError(f'EDM regime must be "pixel" or "latent", got {self.regime!r}')
        sd = self.sigma_data if self.sigma_data is not None else (0.5 if self.regime == "pixel" else 1.0)
        scale = sd / 0.5
        return Process(
            KarrasSchedule(0.002 * scale, 80.0 * scale, self.rho),
            KarrasPreconditioning(sd),
            ScheduleWeighting(),
            LogNormalSigmas(-1.2 + math.log(scale), 1.2),
        )


@dataclasses.dataclass(frozen=True)
class Karras:
    """Karras preconditioning on the Karras schedule, with t uniform over the schedule in training."""

    sigma_min: float = 0.002
    sigma_max: float = 80.0
    rho: float = 7.0
    sigma_data: float = 0.5

    def __call__(self) -> Process:
        return Process(KarrasSchedule(self.sigma_min, self.sigma_max, self.rho),
                       KarrasPreconditioning(self.sigma_data), ScheduleWeighting(), UniformTimes(0.0, 1.0))


@dataclasses.dataclass(frozen=True)
class Cosine:
    """The cosine VP schedule (Nichol & Dhariwal 2021) with eps- (default) or v-prediction."""

    prediction: str = "eps"

    def __call__(self) -> Process:
        transforms = {"eps": EpsilonPrediction(), "v": VPrediction()}
        if self.prediction not in transforms:
            raise ValueError(f'Cosine prediction must be "eps" or "v", got {self.prediction!r}')
        return Process(CosineSchedule(), transforms[self.prediction])


@dataclasses.dataclass(frozen=True)
class Flow:
    """Rectified flow with velocity prediction; ``times="logit_normal"`` trains on SD3's
    logit-normal times, ``shift`` moves the sampling grid toward noise."""

    shift: float = 1.0
    times: str = "uniform"

    def __call__(self) -> Process:
        if self.times not in ("uniform", "logit_normal"):
            raise ValueError(f'Flow times must be "uniform" or "logit_normal", got {self.times!r}')
        times = UniformTimes(0.0, 1.0) if self.times == "uniform" else LogitNormalTimes()
        return Process(FlowSchedule(shift=self.shift), FlowPrediction(), ScheduleWeighting(), times)


@dataclasses.dataclass(frozen=True)
class Sqrt:
    """The sqrt schedule of Diffusion-LM (Li et al. 2022) with x0-prediction, as that paper trains."""

    def __call__(self) -> Process:
        return Process(SqrtSchedule(), X0Prediction())
