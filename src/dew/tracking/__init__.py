"""Experiment tracking: a protocol, typed records, the local backend and the service backends
(TensorBoard, W&B, MLflow; each imports its library only when constructed)."""

from dew.tracking.base import Tracker, Trackers, TrackerWarning
from dew.tracking.local import LocalTracker
from dew.tracking.mlflow import MLflowTracker
from dew.tracking.records import (
    Artifact,
    CheckpointRejected,
    CheckpointSaved,
    Failure,
    ProfileCaptured,
    Progress,
    RunStarted,
    SweepTrial,
)
from dew.tracking.tensorboard import TensorBoardTracker
from dew.tracking.wandb import WandbTracker

__all__ = [
    "Artifact",
    "CheckpointRejected",
    "CheckpointSaved",
    "Failure",
    "LocalTracker",
    "MLflowTracker",
    "ProfileCaptured",
    "Progress",
    "RunStarted",
    "SweepTrial",
    "TensorBoardTracker",
    "Tracker",
    "TrackerWarning",
    "Trackers",
    "WandbTracker",
]
