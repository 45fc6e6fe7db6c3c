"""Typed records a tracker receives beside plain scalars."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RunStarted:
    """A run began (or resumed): its settings and where it starts."""

    config: dict[str, Any]
    start_step: int
    target_step: int


@dataclasses.dataclass(frozen=True)
class Progress:
    """Training progress at a logging step."""

    step: int
    target_step: int
    steps_per_second: float
    eta_seconds: float


@dataclasses.dataclass(frozen=True)
class CheckpointSaved:
    """A checkpoint of `step` was requested (its write may still be in flight)."""

    step: int
    directory: str


@dataclasses.dataclass(frozen=True)
class Failure:
    """The run stopped on an error at `step`."""

    step: int
    message: str
    last_checkpoint: int | None


@dataclasses.dataclass(frozen=True)
class CheckpointRejected:
    """A checkpoint step was found damaged on resume; the run restored `restored_step` instead."""

    step: int
    message: str
    restored_step: int


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A displayable result: text, or an image (uint8 HWC or a grid)."""

    name: str
    kind: str  # "text" or "image"
    data: Any

    def __post_init__(self):
        if self.kind not in ("text", "image"):
            raise ValueError(f"Artifact kind must be 'text' or 'image'; got {self.kind!r}.")

    @property
    def text(self) -> str:
        """A text artifact's data as one string (a sequence of lines joined by newlines)."""
        return self.data if isinstance(self.data, str) else "\n".join(self.data)


@dataclasses.dataclass(frozen=True)
class ProfileCaptured:
    """A profiler trace of training steps `first_step..last_step` (inclusive) was written to
    `directory`; `manifest` is the capture's manifest (backend, versions, reports)."""

    directory: str
    first_step: int
    last_step: int
    manifest: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class SweepTrial:
    """One trial of a sweep ended: its index, the overrides it ran with, "finished" or "failed",
    the value it scored (None when it failed), for a failure the error message, and the trial's
    run directory."""

    index: int
    params: dict[str, Any]
    status: str
    metric: float | None
    message: str | None = None
    directory: str | None = None

    def __post_init__(self):
        if self.status not in ("finished", "failed"):
            raise ValueError(f"SweepTrial status must be 'finished' or 'failed'; got {self.status!r}.")


def as_dict(record: Any) -> dict[str, Any]:
    """A record as a JSON-ready dict with its type name under "record"."""
    return {"record": type(record).__name__, **dataclasses.asdict(record)}


def step_of(record: Any, step: int | None = None) -> int | None:
    """The training step a record belongs to: its own step, where it has one, else `step`."""
    if isinstance(record, RunStarted):
        return record.start_step
    if isinstance(record, SweepTrial):
        return record.index
    if isinstance(record, ProfileCaptured):
        return record.last_step
    own = getattr(record, "step", None)
    return int(own) if isinstance(own, (int, float)) and not isinstance(own, bool) else step


def scalars_of(record: Any) -> dict[str, float]:
    """The numbers in a record that a backend plots as scalars at `step_of(record)`."""
    if isinstance(record, Progress):
        return {"progress/steps_per_second": record.steps_per_second, "progress/eta_seconds": record.eta_seconds}
    if isinstance(record, SweepTrial) and record.metric is not None:
        return {"sweep/metric": float(record.metric)}
    if isinstance(record, CheckpointSaved):
        return {"checkpoint/step": float(record.step)}
    return {}
