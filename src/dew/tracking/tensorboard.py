"""A tracker that writes TensorBoard event files (through tensorboardX: the `tensorboard` extra)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from dew.pixels import to_uint8
from dew.tracking.base import Tracker
from dew.tracking.records import Artifact, RunStarted, as_dict, scalars_of, step_of


class TensorBoardTracker(Tracker):
    """Scalars as scalar summaries, images as images, text as text, and each typed record as a
    JSON text summary under `records/<RecordName>`; the run configuration is `run/config`."""

    def __init__(self, directory: str | os.PathLike, flush_seconds: float = 10.0):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as error:
            raise ImportError(
                "TensorBoardTracker needs tensorboardX: pip install 'dewml[tensorboard]'."
            ) from error
        self.directory = Path(directory)
        self._writer = SummaryWriter(logdir=str(self.directory), flush_secs=flush_seconds)

    def log(self, data, step=None):
        if isinstance(data, Mapping):
            for name, value in data.items():
                self._writer.add_scalar(str(name), float(np.asarray(value)), global_step=step)
        elif dataclasses.is_dataclass(data):
            step = step_of(data, step)
            for name, value in scalars_of(data).items():
                self._writer.add_scalar(name, value, global_step=step)
            if isinstance(data, RunStarted):
                self._writer.add_text("run/config", json.dumps(data.config, indent=2, default=str), step)
            self._writer.add_text(
                f"records/{type(data).__name__}", json.dumps(as_dict(data), default=str), step
            )
        else:
            raise TypeError(
                f"TensorBoardTracker.log takes a mapping of scalars or a record; got {type(data).__name__}."
            )

    def artifact(self, artifact: Artifact, step=None):
        if artifact.kind == "text":
            self._writer.add_text(artifact.name, artifact.text, step)
        else:
            image = to_uint8(artifact.data)
            self._writer.add_image(artifact.name, image, step, dataformats="HWC" if image.ndim == 3 else "HW")

    def close(self):
        self._writer.close()
