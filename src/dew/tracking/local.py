"""A tracker that needs no service: JSON lines, artifact files and plots in one directory."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dew.files import write_atomic
from dew.pixels import png_bytes
from dew.tracking.base import Tracker
from dew.tracking.records import Artifact, as_dict


class LocalTracker(Tracker):
    """Write scalars to `scalars.jsonl`, records to `records.jsonl`, artifacts under `artifacts/`.

    With `plots=True`, closing draws one PNG per scalar under `plots/` (needs matplotlib: the
    `plots` extra).
    """

    def __init__(self, directory: str | os.PathLike, plots: bool = True):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.plots = plots
        self._scalars = open(self.directory / "scalars.jsonl", "a", encoding="utf-8")
        self._records = open(self.directory / "records.jsonl", "a", encoding="utf-8")
        self._closed = False

    def log(self, data, step=None):
        self._check_open()
        if isinstance(data, Mapping):
            row = {"step": None if step is None else int(step)}
            row.update({str(k): _number(v) for k, v in data.items()})
            self._scalars.write(json.dumps(row) + "\n")
            self._scalars.flush()
        elif dataclasses.is_dataclass(data):
            self._records.write(json.dumps(as_dict(data), default=str) + "\n")
            self._records.flush()
        else:
            raise TypeError(
                f"LocalTracker.log takes a mapping of scalars or a record; got {type(data).__name__}."
            )

    def artifact(self, artifact: Artifact, step=None):
        self._check_open()
        folder = self.directory / "artifacts"
        folder.mkdir(exist_ok=True)
        stem = f"{artifact.name}" + ("" if step is None else f"-{int(step):08d}")
        if artifact.kind == "text":
            path = folder / f"{stem}.txt"
            write_atomic(path, artifact.text)
        else:
            path = folder / f"{stem}.png"
            write_atomic(path, png_bytes(artifact.data))
        self.log(_ArtifactWritten(artifact.name, artifact.kind, str(path), step))
        return path

    def history(self) -> dict[str, list[tuple[int, float]]]:
        """Every scalar written so far, as name -> [(step, value)]."""
        self._scalars.flush()
        series: dict[str, list[tuple[int, float]]] = {}
        with open(self.directory / "scalars.jsonl", encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                step = row.pop("step")
                for name, value in row.items():
                    if value is not None:
                        series.setdefault(name, []).append((step, value))
        return series

    def plot(self) -> list[Path]:
        """Draw each scalar's history to `plots/<name>.png`; returns the files written."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise ImportError(
                "LocalTracker plots need matplotlib: pip install 'dewml[plots]', "
                "or use LocalTracker(..., plots=False)."
            ) from error
        folder = self.directory / "plots"
        folder.mkdir(exist_ok=True)
        written = []
        for name, points in self.history().items():
            steps, values = zip(*[(s, v) for s, v in points if s is not None]) if points else ((), ())
            if not steps:
                continue
            figure, axis = plt.subplots(figsize=(5, 3.2))
            axis.plot(steps, values, marker="." if len(steps) < 50 else None)
            axis.set_xlabel("step")
            axis.set_title(name)
            axis.grid(alpha=0.3)
            figure.tight_layout()
            path = folder / (name.replace("/", "_") + ".png")
            drawn = io.BytesIO()
            figure.savefig(drawn, format="png", dpi=90)
            plt.close(figure)
            write_atomic(path, drawn.getvalue())
            written.append(path)
        return written

    def close(self):
        if self._closed:
            return
        self._scalars.flush()
        if self.plots:
            self.plot()
        self._scalars.close()
        self._records.close()
        self._closed = True

    def _check_open(self):
        if self._closed:
            raise RuntimeError(f"LocalTracker({str(self.directory)!r}) is closed.")


@dataclasses.dataclass(frozen=True)
class _ArtifactWritten:
    name: str
    kind: str
    path: str
    step: int | None


def _number(value: Any) -> float | None:
    value = float(np.asarray(value))
    return value if math.isfinite(value) else None


