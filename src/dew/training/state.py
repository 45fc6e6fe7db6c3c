"""The training state: one pytree holding everything a step reads and writes."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct


@struct.dataclass
class TrainState:
    """Progress, variables, optimizer state, the EMA copy and the run's root key.

    `step` counts training steps taken (batches consumed); `updates` counts optimizer updates
    applied. `variables` is the whole Flax mapping; `ema` is an averaged copy of `variables["params"]`
    or None when the objective keeps no average.
    """

    step: jax.Array
    updates: jax.Array
    variables: dict[str, Any]
    opt_state: Any
    ema: Any
    key: jax.Array

    @property
    def params(self):
        return self.variables["params"]

    @property
    def averaged(self) -> dict[str, Any]:
        """The variables with the EMA parameters in place of the live ones."""
        if self.ema is None:
            raise ValueError(
                "This state keeps no EMA copy (the objective's ema_decay is None); "
                "use state.variables, or set ema_decay on the objective."
            )
        return {**self.variables, "params": self.ema}
