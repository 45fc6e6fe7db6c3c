"""A tracker that records to an MLflow tracking store (a server, or a local `sqlite:///` file;
the `mlflow` extra)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dew.pixels import to_uint8
from dew.tracking.base import Tracker
from dew.tracking.records import Artifact, Failure, Progress, RunStarted, as_dict, scalars_of, step_of


class MLflowTracker(Tracker):
    """One MLflow run in `experiment` (created when missing) at tracking `uri`.

    Scalars become metrics at their steps; the run configuration becomes the run's parameters
    (flattened, first start only) and `run/config.json`; every other record except progress is
    kept as JSON under `records/`; text artifacts as `.txt` files and images as MLflow images. A
    `Failure` marks the run FAILED when the tracker closes. `artifacts` sets where a new
    experiment stores files; for a `sqlite:///` store the default is `mlflow-artifacts/` beside
    the database, so nothing lands in the working directory.
    """

    def __init__(
        self,
        experiment: str,
        uri: str | None = None,
        *,
        run_name: str | None = None,
        artifacts: str | None = None,
        tags: Mapping[str, str] | None = None,
    ):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as error:
            raise ImportError("MLflowTracker needs mlflow: pip install 'dewml[mlflow]'.") from error
        if not isinstance(experiment, str) or not experiment:
            raise ValueError(f"MLflowTracker needs an experiment name; got {experiment!r}.")
        self._client = MlflowClient(tracking_uri=uri)
        found = self._client.get_experiment_by_name(experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            experiment_id = self._client.create_experiment(
                experiment, artifact_location=artifacts or _beside_sqlite(uri)
            )
        run = self._client.create_run(experiment_id, run_name=run_name, tags=dict(tags or {}))
        self.run_id = run.info.run_id
        self.experiment_id = experiment_id
        self._has_params = False
        self._failed = False
        self._closed = False

    def log(self, data, step=None):
        if isinstance(data, Mapping):
            self._metrics({str(k): float(np.asarray(v)) for k, v in data.items()}, step)
        elif dataclasses.is_dataclass(data):
            step = step_of(data, step)
            self._metrics(scalars_of(data), step)
            if isinstance(data, RunStarted):
                self._client.log_dict(self.run_id, data.config, "run/config.json")
                if not self._has_params:  # MLflow parameters cannot change once set
                    self._params(_flatten(data.config))
                    self._has_params = True
            elif isinstance(data, Failure):
                self._failed = True
                self._client.set_tag(self.run_id, "dew.failure", data.message[:5000])
            if not isinstance(data, Progress):
                name = f"records/{type(data).__name__}-{0 if step is None else int(step):08d}.json"
                self._client.log_text(self.run_id, json.dumps(as_dict(data), default=str, indent=2), name)
        else:
            raise TypeError(
                f"MLflowTracker.log takes a mapping of scalars or a record; got {type(data).__name__}."
            )

    def artifact(self, artifact: Artifact, step=None):
        if artifact.kind == "text":
            self._client.log_text(self.run_id, artifact.text, f"{artifact.name}/step-{step or 0:08d}.txt")
        else:
            self._client.log_image(self.run_id, to_uint8(artifact.data), key=artifact.name, step=step or 0)

    def close(self):
        if not self._closed:
            self._client.set_terminated(self.run_id, status="FAILED" if self._failed else "FINISHED")
            self._closed = True

    def _params(self, values: dict[str, str]) -> None:
        from mlflow.entities import Param

        params = [Param(name, value) for name, value in values.items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self._client.log_batch(self.run_id, params=params[start : start + 100])

    def _metrics(self, values: dict[str, float], step: int | None) -> None:
        if not values:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, 0 if step is None else int(step)) for name, value in values.items()]
        self._client.log_batch(self.run_id, metrics=metrics)


def _beside_sqlite(uri: str | None) -> str | None:
    """`mlflow-artifacts/` next to a `sqlite:///path` database; None (the server decides) else."""
    if uri is None or not uri.startswith("sqlite:///"):
        return None
    return (Path(uri[len("sqlite:///") :]).absolute().parent / "mlflow-artifacts").as_uri()


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested settings as dotted parameter names with string values (MLflow's limit: 6000 chars)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, prefix=f"{name}."))
        else:
            flat[name] = (value if isinstance(value, str) else json.dumps(value, default=str))[:6000]
    return flat
