"""The objective contract: what a model is, how it starts, and what it minimizes.

An `Objective` owns its model. The trainer calls `init` once, then `loss` inside one jitted step;
`evaluate` and `preview` serve validation. Everything an objective returns is a plain pytree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

Variables = dict[str, Any]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Step:
    """Where the loss is evaluated: the update count and this step's random key."""

    step: jax.Array
    key: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Aux:
    """What a loss returns beside its scalar: metrics to log and updated non-param collections.

    `variables` holds collections such as `batch_stats` that the forward pass changed; the trainer
    writes them back into the state after the update.
    """

    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    variables: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Field:
    """One named input of an example. `shape` excludes the batch axis; None matches any size."""

    key: str
    shape: tuple[int | None, ...]
    dtype: Any = None

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(self.shape))

    def check(self, array: Any, batch: int | None = None) -> None:
        """Raise a ValueError when `array` (a batch of this field) does not fit."""
        shape = tuple(np.shape(array))
        expected = ("batch",) + tuple("any" if d is None else d for d in self.shape)
        fits = len(shape) == len(self.shape) + 1 and all(
            want is None or want == got for want, got in zip(self.shape, shape[1:])
        )
        if not fits:
            raise ValueError(
                f"Batch field {self.key!r} has shape {shape}, but the objective expects "
                f"{expected} (batch axis first). Reshape the data or change the objective's InputSpec."
            )
        if batch is not None and shape[0] != batch:
            raise ValueError(
                f"Batch field {self.key!r} has {shape[0]} rows, but the other fields have {batch}."
            )
        if self.dtype is not None and np.dtype(np.asarray(array).dtype) != np.dtype(self.dtype):
            raise ValueError(
                f"Batch field {self.key!r} has dtype {np.asarray(array).dtype}, but the objective "
                f"expects {np.dtype(self.dtype)}."
            )


class InputSpec:
    """The fields one example holds, plus optional conditions (labels, embeddings, captions)."""

    def __init__(self, *fields: Field, conditions: Mapping[str, Field] | None = None):
        for field in fields:
            if not isinstance(field, Field):
                raise TypeError(f"InputSpec takes Field objects; got {field!r}.")
        self.fields = tuple(fields)
        self.conditions = dict(conditions or {})

    def __repr__(self) -> str:
        return f"InputSpec({', '.join(map(repr, self.fields))}, conditions={self.conditions!r})"

    def __record__(self) -> tuple[tuple[Field, ...], dict[str, Any]]:
        """How a run record rebuilds this spec: ``InputSpec(*fields, conditions=...)``."""
        return self.fields, {"conditions": self.conditions}

    def tokenize(self, captions: list[str]) -> dict[str, np.ndarray]:
        """Captions -> the token columns the caption conditions read (`TextCondition.tokenize`), as a
        data reader's ``load(tokenize=...)`` takes it; with no caption condition, no columns."""
        return {field.key: field.tokenize(captions) for field in self.conditions.values() if hasattr(field, "tokenize")}

    def all_fields(self) -> tuple[Field, ...]:
        return self.fields + tuple(self.conditions.values())

    def check(self, batch: Mapping[str, Any], *, optional_conditions: bool = False) -> None:
        """Check one batch against the spec, naming the field and both shapes on a mismatch."""
        if not isinstance(batch, Mapping):
            raise TypeError(f"A batch must be a dict of arrays; got {type(batch).__name__}.")
        rows = None
        for field in self.all_fields():
            if field.key not in batch:
                if optional_conditions and field in self.conditions.values():
                    continue
                raise ValueError(
                    f"The batch has no field {field.key!r} (it has {sorted(batch)}); the objective "
                    f"expects {field.key!r} with per-example shape {field.shape}."
                )
            field.check(batch[field.key], rows)
            rows = np.shape(batch[field.key])[0]


class Objective:
    """Base class for a training objective.

    Subclasses implement `init` and `loss`; the rest is optional. Class attributes work as settings
    (`model = nn.Dense(1)`, `inputs = InputSpec(...)`, `ema_decay = 0.999`).
    """

    inputs: InputSpec | None = None
    ema_decay: float | None = None

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        """Return the whole Flax variables mapping (`{"params": ...}` plus other collections)."""
        raise NotImplementedError(f"{type(self).__name__} must implement init(key, variables=None).")

    def loss(self, variables: Variables, batch: Mapping[str, jax.Array], step: Step):
        """Return `(scalar loss, Aux)` for one batch."""
        raise NotImplementedError(f"{type(self).__name__} must implement loss(variables, batch, step).")

    def check(self, batch: Mapping[str, Any]) -> None:
        """Check the first batch on the host, before compiling; raise with a clear message.

        By default this checks `inputs`; objectives add their own checks (token ids in range).
        """
        if self.inputs is not None:
            self.inputs.check(batch)

    def evaluate(self, variables: Variables, batch: Mapping[str, jax.Array], step: Step):
        """Outputs that validation metrics read. By default the loss and the loss's metrics."""
        loss, aux = self.loss(variables, batch, step)
        return {"loss": loss, **aux.metrics}

    def preview(self, variables: Variables, key: jax.Array, step: int) -> list:
        """Display artifacts (text, images) drawn from `variables`. By default none."""
        return []

    def after_update(self, variables: Variables, step: Step) -> Variables:
        """Adjust variables after each optimizer update (a target encoder's EMA, say). Pure."""
        return variables

    @property
    def frozen_collections(self) -> tuple[str, ...]:
        """Variable collections held fixed at the starting weights (an adapted model's frozen base,
        `dew.nn.adapters.LoRADecoder`): checkpoints leave them out, and a resumed run takes them
        from `init` again. Read from the objective's model."""
        return tuple(getattr(getattr(self, "model", None), "frozen_collections", ()))

    #: What to use instead of a generation task, for objectives that have none (said in the error).
    no_task_hint: str = "use the trained variables directly (state.variables, or Checkpoints.restore_variables)"

    def pipeline(self, state, *, ema: bool = True, processor: Any = None):
        """The inference task over a trained state. Objectives that generate override this."""
        raise TypeError(
            f"{type(self).__name__} runs have no generation task, so they have no pipeline; "
            f"{self.no_task_hint}."
        )


def inference_variables(state: Any, ema: bool) -> Variables:
    """The variables a task publishes: the EMA weights over the live ones when `ema`, else the live.

    ``ema=True`` on a state without an EMA copy raises rather than silently using the live weights.
    """
    if not ema:
        return state.variables
    if state.ema is None:
        raise ValueError(
            "ema=True asks for the moving-average weights, but this run keeps no EMA copy (its "
            "objective's ema_decay is None). Pass ema=False for the live weights."
        )
    return state.averaged
