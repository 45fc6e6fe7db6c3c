"""Scoring variables on a validation pass, without an optimizer.

The objective's `evaluate` turns each batch into outputs (arrays); metrics fold those outputs into
an accumulator over the whole pass and report scores at the end, so a metric such as perplexity is
computed from the pass's totals rather than averaged over batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from dew.data.dataset import Partition


class Metric(Protocol):
    """A score accumulated over a validation pass.

    `update` receives one batch's evaluation outputs as host NumPy arrays.
    """

    name: str

    def empty(self) -> Any: ...

    def update(self, accumulator: Any, outputs: Mapping[str, np.ndarray]) -> Any: ...

    def result(self, accumulator: Any) -> Mapping[str, float]: ...


@dataclasses.dataclass(frozen=True)
class MeanOutputs:
    """The mean over the pass of every scalar output, weighted by the batch's rows.

    Outputs whose names start with "_" are inputs to other metrics (sums, counts) and are skipped.
    """

    name: str = "mean"

    def empty(self):
        return {}, 0

    def update(self, accumulator, outputs):
        sums, rows = accumulator
        batch_rows = int(outputs.get("_rows", 1))
        sums = dict(sums)
        for key, value in outputs.items():
            if key.startswith("_") or np.ndim(value) != 0:
                continue
            sums[key] = sums.get(key, 0.0) + float(value) * batch_rows
        return sums, rows + batch_rows

    def result(self, accumulator):
        sums, rows = accumulator
        return {key: total / max(rows, 1) for key, total in sums.items()}


@dataclasses.dataclass(frozen=True)
class EvaluationResult:
    """Scores of one pass (`val/<name>`), the step they belong to, and any previews."""

    scores: dict[str, float]
    step: int
    previews: list = dataclasses.field(default_factory=list)
    batches: int = 0

    @property
    def scalars(self) -> dict[str, float]:
        return dict(self.scores)


class Evaluation:
    """Run an objective's validation pass with metrics; reuse one instance to avoid recompiling."""

    def __init__(self, objective, *, mesh=None):
        self.objective = objective
        self._evaluate = jax.jit(self._outputs)

    def _outputs(self, variables, batch, key, step):
        from dew.objectives.base import Step

        return self.objective.evaluate(variables, batch, Step(step=step, key=key))

    @classmethod
    def run(
        cls,
        objective,
        variables,
        val: Callable[[Partition], Iterator] | None,
        *,
        metrics: Sequence[Metric] = (),
        key: jax.Array,
        step: int = 0,
        preview: bool = False,
        place: Callable[[dict], Any] | None = None,
    ) -> EvaluationResult:
        """Score `variables` on one pass over the `val` factory; optionally draw previews."""
        return cls(objective).score(
            variables, val, metrics=metrics, key=key, step=step, preview=preview, place=place
        )

    def score(self, variables, val, *, metrics=(), key, step=0, preview=False, place=None):
        scores: dict[str, float] = {}
        batches = 0
        if val is not None:
            everything: list[Metric] = [MeanOutputs(), *metrics]
            accumulators = [metric.empty() for metric in everything]
            eval_key = jax.random.fold_in(key, step)
            for index, batch in enumerate(val(Partition.current())):
                rows = len(next(iter(batch.values())))
                device_batch = place(batch) if place is not None else batch
                outputs = self._evaluate(
                    variables, device_batch, jax.random.fold_in(eval_key, index), np.int32(step)
                )
                outputs = {k: np.asarray(v) for k, v in jax.device_get(outputs).items()}
                outputs["_rows"] = np.asarray(rows)
                accumulators = [m.update(a, outputs) for m, a in zip(everything, accumulators)]
                batches += 1
            if batches == 0:
                raise ValueError("The validation factory yielded no batches; nothing to score.")
            for metric, accumulator in zip(everything, accumulators):
                scores.update({f"val/{k}": float(v) for k, v in metric.result(accumulator).items()})
        previews = []
        if preview:
            preview_key = jax.random.fold_in(key, 2**31 - 1)  # a stream apart from the batches
            previews = list(self.objective.preview(variables, preview_key, step))
        return EvaluationResult(scores=scores, step=int(step), previews=previews, batches=batches)
