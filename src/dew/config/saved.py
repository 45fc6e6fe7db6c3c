"""A saved run read back: its record, its model and objective rebuilt, and one step's weights.

`load_run(directory, step=None)` is what `dew.pipeline`, `dew export` and
`PretrainedDecoder.from_run` share, so a run reads the same way wherever it is opened.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dew.config.records import resolve
from dew.config.run import RUN_FILE, RunConfig


@dataclasses.dataclass(frozen=True, eq=False)
class SavedRun:
    """One step of a saved run.

    Attributes:
      directory: the run directory (run.json beside its checkpoint steps).
      config: the RunConfig recorded in run.json.
      objective_class: the objective's class, resolved from the record without building it.
      step: the checkpoint step read.
      variables: the live Flax variables of that step (host arrays, as saved).
      ema: the EMA copy of the params at that step, or None when the run keeps none.
    """

    directory: Path
    config: RunConfig
    objective_class: type
    step: int
    variables: dict[str, Any]
    ema: Any

    def state(self) -> Any:
        """A TrainState with this step's weights and no optimizer state, for `objective.pipeline`."""
        import jax.numpy as jnp

        from dew.training.state import TrainState

        step = jnp.asarray(self.step, jnp.int32)
        return TrainState(step=step, updates=step, variables=self.variables, opt_state=None, ema=self.ema, key=None)

    def tokenizer(self) -> Any:
        """The run's tokenizer rebuilt from the files stored with it, or None."""
        return self.config.tokenizer_in(self.directory)


def objective_class(config: RunConfig, directory: Path) -> type:
    """The objective class a run record names, with a clear error when it names none."""
    if config.objective is None:
        raise ValueError(
            f"{directory / RUN_FILE} names no objective, so it does not say which task the run serves. "
            "Save the run with RunConfig(objective=ObjectiveConfig.from_objective(objective))."
        )
    return resolve(config.objective.target)


def load_run(directory: str | Path, *, step: int | None = None) -> SavedRun:
    """Read run.json and the weights of `step` (the newest complete step by default)."""
    from dew.training.checkpoints import Checkpoints

    directory = Path(directory).expanduser()
    config = RunConfig.load(directory)
    cls = objective_class(config, directory)
    checkpoints = Checkpoints(directory)
    steps = checkpoints.steps()
    if not steps:
        raise FileNotFoundError(f"The run {directory} has run.json but no complete checkpoint step.")
    if step is not None and step not in steps:
        raise ValueError(f"The run {directory} has no checkpoint at step {step!r}; its steps are {steps}.")
    variables, ema, found = checkpoints.restore_variables(steps[-1] if step is None else step)
    return SavedRun(directory=directory, config=config, objective_class=cls, step=int(found),
                    variables=variables, ema=ema)
