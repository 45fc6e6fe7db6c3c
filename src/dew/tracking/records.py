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


def as_dict(record: Any) -> dict[str, Any]:
    """A record as a JSON-ready dict with its type name under "record"."""
    return {"record": type(record).__name__, **dataclasses.asdict(record)}
