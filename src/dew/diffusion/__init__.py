"""The math of noising: schedules, prediction transforms, loss weightings, Process, presets."""

from dew.diffusion.presets import EDM, Cosine, Flow, Karras, Sqrt, as_process
from dew.diffusion.process import (Denoiser, Example, LogitNormalTimes, LogNormalSigmas, Process,
                                   UniformTimes)
from dew.diffusion.schedules import (CosineSchedule, ExponentialSchedule, FlowSchedule,
                                     KarrasSchedule, LinearSchedule, Schedule, SqrtSchedule,
                                     exponential_sigmas, karras_sigmas)
from dew.diffusion.transforms import (EpsilonPrediction, FlowPrediction, KarrasPreconditioning,
                                      Transform, VPrediction, X0Prediction)
from dew.diffusion.weighting import MinSNRWeighting, P2Weighting, ScheduleWeighting

__all__ = [
    "EDM", "Cosine", "Flow", "Karras", "Sqrt", "as_process",
    "Denoiser", "Example", "LogitNormalTimes", "LogNormalSigmas", "Process", "UniformTimes",
    "CosineSchedule", "ExponentialSchedule", "FlowSchedule", "KarrasSchedule", "LinearSchedule",
    "Schedule", "SqrtSchedule", "exponential_sigmas", "karras_sigmas",
    "EpsilonPrediction", "FlowPrediction", "KarrasPreconditioning", "Transform", "VPrediction",
    "X0Prediction", "MinSNRWeighting", "P2Weighting", "ScheduleWeighting",
]
