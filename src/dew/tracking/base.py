"""The tracker protocol and fan-out to several trackers.

A tracker implements `log(data, step=None)` (a mapping of scalars, or a typed record from
`dew.tracking.records`), `artifact(artifact, step)` and `close()`; trackers are context managers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Tracker:
    """Base class: subclasses override what they record; the rest does nothing."""

    def log(self, data: Mapping[str, float] | Any, step: int | None = None) -> None:
        pass

    def artifact(self, artifact: Any, step: int | None = None) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Trackers(Tracker):
    """Send every report to each of several trackers, in order."""

    def __init__(self, *trackers: Tracker):
        for tracker in trackers:
            for method in ("log", "artifact", "close"):
                if not callable(getattr(tracker, method, None)):
                    raise TypeError(
                        f"{type(tracker).__name__} is not a tracker: it has no {method}() method."
                    )
        self.trackers = trackers

    def log(self, data, step=None):
        for tracker in self.trackers:
            tracker.log(data, step=step)

    def artifact(self, artifact, step=None):
        for tracker in self.trackers:
            tracker.artifact(artifact, step=step)

    def close(self):
        for tracker in self.trackers:
            tracker.close()
