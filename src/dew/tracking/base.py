"""The tracker protocol and fan-out to several trackers.

A tracker implements `log(data, step=None)` (a mapping of scalars, or a typed record from
`dew.tracking.records`), `artifact(artifact, step)` and `close()`; trackers are context managers.
`Trackers` is also where a failing backend is contained: tracking never stops training.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any


class TrackerWarning(RuntimeWarning):
    """A tracker raised; the run goes on without that report."""


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
    """Send every report to each of several trackers, in order.

    A tracker that raises (a full disk, a backend that is down) does not stop the others or the
    run: its first error is reported once as a `TrackerWarning`, later ones are counted in
    `failures` only, and the next report is offered to it again.
    """

    def __init__(self, *trackers: Tracker):
        for tracker in trackers:
            for method in ("log", "artifact", "close"):
                if not callable(getattr(tracker, method, None)):
                    raise TypeError(
                        f"{type(tracker).__name__} is not a tracker: it has no {method}() method."
                    )
        self.trackers = trackers
        self.failures: list[tuple[Any, str, BaseException]] = []  # (tracker, method, error)

    def log(self, data, step=None):
        self._each("log", data, step=step)

    def artifact(self, artifact, step=None):
        self._each("artifact", artifact, step=step)

    def close(self):
        self._each("close")

    def _each(self, method: str, *args, **kwargs) -> None:
        for tracker in self.trackers:
            try:
                getattr(tracker, method)(*args, **kwargs)
            except Exception as error:
                first = all(failed is not tracker for failed, _, _ in self.failures)
                self.failures.append((tracker, method, error))
                if first:
                    warnings.warn(
                        f"{type(tracker).__name__}.{method}() raised {type(error).__name__}: {error}. "
                        "Training goes on without this report; further errors from this tracker "
                        "are collected in Trackers.failures without a warning.",
                        TrackerWarning,
                        stacklevel=3,
                    )
