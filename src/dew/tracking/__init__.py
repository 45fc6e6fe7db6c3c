"""Experiment tracking: a protocol, typed records, and the local backend."""

from dew.tracking.base import Tracker, Trackers
from dew.tracking.local import LocalTracker
from dew.tracking.records import Artifact, CheckpointRejected, CheckpointSaved, Failure, Progress, RunStarted

__all__ = [
    "Artifact",
    "CheckpointRejected",
    "CheckpointSaved",
    "Failure",
    "LocalTracker",
    "Progress",
    "RunStarted",
    "Tracker",
    "Trackers",
]
