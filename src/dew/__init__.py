"""Dew: one JAX trainer for language models, diffusion models and JEPA encoders.

Importing ``dew`` is cheap: every public name is resolved on first use, so ``import dew`` pulls in
no optional package and initializes no JAX backend. It does set glibc's malloc to keep XLA:CPU's
per-step temporaries mapped (`dew.host_memory`; ``DEW_HOST_MEMORY=system`` opts out).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dew._lazy import lazy_getattr
from dew.host_memory import reuse_freed_memory

__version__ = "0.1.0"

reuse_freed_memory()  # before JAX starts its worker threads; see dew/host_memory.py

# public name -> module that defines it
_EXPORTS = {
    "Trainer": "dew.training.trainer",
    "TrainState": "dew.training.state",
    "Checkpoints": "dew.training.checkpoints",
    "MeshSpec": "dew.training.mesh",
    "Layout": "dew.training.mesh",
    "Dataset": "dew.data.dataset",
    "Loading": "dew.data.dataset",
    "Field": "dew.objectives.base",
    "InputSpec": "dew.objectives.base",
    "Objective": "dew.objectives.base",
    "Aux": "dew.objectives.base",
    "Step": "dew.objectives.base",
    "Evaluation": "dew.eval.evaluation",
    "LocalTracker": "dew.tracking.local",
    "Trackers": "dew.tracking.base",
    "TensorBoardTracker": "dew.tracking.tensorboard",
    "WandbTracker": "dew.tracking.wandb",
    "MLflowTracker": "dew.tracking.mlflow",
    "Profiler": "dew.telemetry.profile",
    "ProfileWindow": "dew.telemetry.profile",
    "pipeline": "dew.inference.pipeline",
    "sample": "dew.sampling.sample",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and editors only
    from dew.data.dataset import Dataset, Loading
    from dew.eval.evaluation import Evaluation
    from dew.inference.pipeline import pipeline
    from dew.sampling.sample import sample
    from dew.objectives.base import Aux, Field, InputSpec, Objective, Step
    from dew.tracking.base import Trackers
    from dew.tracking.local import LocalTracker
    from dew.tracking.mlflow import MLflowTracker
    from dew.tracking.tensorboard import TensorBoardTracker
    from dew.tracking.wandb import WandbTracker
    from dew.telemetry.profile import Profiler, ProfileWindow
    from dew.training.checkpoints import Checkpoints
    from dew.training.mesh import Layout, MeshSpec
    from dew.training.state import TrainState
    from dew.training.trainer import Trainer
