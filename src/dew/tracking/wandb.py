"""A tracker that records a Weights & Biases run, offline by default (the `wandb` extra)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dew.pixels import to_uint8
from dew.tracking.base import Tracker
from dew.tracking.records import Artifact, Failure, Progress, RunStarted, SweepTrial, as_dict, scalars_of, step_of


class WandbTracker(Tracker):
    """One W&B run in `project`. With `offline=True` (the default) the run is written under
    `directory` only, for `wandb sync` later, and nothing goes over the network.

    Scalars are logged at their steps; the run configuration updates the run's config; sweep
    trials are plotted against `sweep/trial`; every other record (except progress) is kept in
    the run summary under `records/<RecordName>`; text artifacts become one-column tables and
    images W&B images. A `Failure` finishes the run with exit code 1 (state "failed").
    Further keyword arguments go to `wandb.init` (`entity`, `tags`, `group`, ...).
    """

    def __init__(
        self,
        project: str,
        *,
        offline: bool = True,
        directory: str | os.PathLike | None = None,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        **init: Any,
    ):
        try:
            import wandb
        except ImportError as error:
            raise ImportError("WandbTracker needs wandb: pip install 'dewml[wandb]'.") from error
        if not isinstance(project, str) or not project:
            raise ValueError(f"WandbTracker needs a project name; got {project!r}.")
        self._wandb = wandb
        self.directory = Path(directory) if directory is not None else None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        init.setdefault("settings", wandb.Settings(console="off", silent=True))
        self.run = wandb.init(
            project=project,
            name=name,
            dir=None if self.directory is None else str(self.directory),
            mode="offline" if offline else "online",
            config=dict(config or {}),
            reinit="create_new",
            **init,
        )
        self.run.define_metric("sweep/trial")
        self.run.define_metric("sweep/*", step_metric="sweep/trial")
        self._failed = False
        self._closed = False

    def log(self, data, step=None):
        if isinstance(data, Mapping):
            self.run.log({str(k): float(np.asarray(v)) for k, v in data.items()}, step=step)
        elif dataclasses.is_dataclass(data):
            if isinstance(data, SweepTrial):
                self.run.log({"sweep/trial": data.index, **scalars_of(data)})
            else:
                step = step_of(data, step)
                scalars = scalars_of(data)
                if scalars:
                    self.run.log(scalars, step=step)
            if isinstance(data, RunStarted):
                self.run.config.update(data.config, allow_val_change=True)
            if isinstance(data, Failure):
                self._failed = True
            if not isinstance(data, Progress):
                self.run.summary[f"records/{type(data).__name__}"] = as_dict(data)
        else:
            raise TypeError(
                f"WandbTracker.log takes a mapping of scalars or a record; got {type(data).__name__}."
            )

    def artifact(self, artifact: Artifact, step=None):
        if artifact.kind == "text":
            lines = [artifact.data] if isinstance(artifact.data, str) else list(artifact.data)
            value = self._wandb.Table(columns=["text"], data=[[line] for line in lines])
        else:
            value = self._wandb.Image(to_uint8(artifact.data))
        self.run.log({artifact.name: value}, step=step)

    def close(self):
        if not self._closed:
            self.run.finish(exit_code=1 if self._failed else 0)
            self._closed = True
