"""Checkpoints: the training state and the data position, saved asynchronously with Orbax.

Each step is written under a temporary name and renamed when complete, so a step directory that
exists is whole; a crash mid-write leaves only a temporary directory, which is never restored.
"""

from __future__ import annotations

import base64
import os
import pickle
from pathlib import Path
from typing import Any

import jax

from dew.training.state import TrainState


class Checkpoints:
    """A directory of checkpoint steps, keeping the newest `keep` (None keeps all)."""

    def __init__(self, directory: str | os.PathLike, keep: int | None = 2):
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"Checkpoints keep must be a positive int or None; got {keep!r}.")
        self.directory = Path(directory).absolute()
        self.keep = keep
        self._manager = None

    def __repr__(self) -> str:
        return f"Checkpoints({str(self.directory)!r}, keep={self.keep})"

    @property
    def manager(self):
        if self._manager is None:
            import orbax.checkpoint as ocp

            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.keep, create=True, enable_async_checkpointing=True
            )
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, item_names=("state", "data")
            )
        return self._manager

    def steps(self) -> list[int]:
        """The complete steps on disk, oldest first."""
        if not self.directory.exists():
            return []
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, state: TrainState, data_position: Any = None) -> None:
        """Start writing `state` at its step; returns once the arrays are copied off the device."""
        import orbax.checkpoint as ocp

        step = int(state.step)
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_to_storable(state)),
                data=ocp.args.JsonSave({"position": _encode_position(data_position)}),
            ),
        )

    def restore(self, abstract: TrainState, step: int | None = None) -> tuple[TrainState, Any]:
        """Read a step (the latest by default) into the shapes and shardings of `abstract`."""
        import orbax.checkpoint as ocp

        step = self.latest() if step is None else step
        if step is None:
            raise FileNotFoundError(f"No complete checkpoint in {self.directory}.")
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_to_storable(abstract)),
                data=ocp.args.JsonRestore(),
            ),
        )
        state = _from_storable(restored["state"], abstract)
        return state, _decode_position(restored["data"]["position"])

    def restore_variables(self, step: int | None = None) -> tuple[dict[str, Any], Any, int]:
        """Only the weights of a step (latest by default): `(variables, ema or None, step)`.

        Needs no optimizer or model: the arrays are read as they were saved.
        """
        import orbax.checkpoint as ocp

        step = self.latest() if step is None else step
        if step is None:
            raise FileNotFoundError(f"No complete checkpoint in {self.directory}.")
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(None)))
        tree = restored["state"]
        return tree["variables"], tree.get("ema"), step

    def wait(self) -> None:
        """Block until every started write is on disk."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None


def _to_storable(state: TrainState) -> dict[str, Any]:
    """A plain dict tree Orbax can write: typed PRNG keys become their raw uint32 data."""
    key = state.key
    if isinstance(key, jax.ShapeDtypeStruct):
        key_data = jax.eval_shape(jax.random.key_data, key)
        if getattr(key, "sharding", None) is not None:
            key_data = jax.ShapeDtypeStruct(key_data.shape, key_data.dtype, sharding=key.sharding)
    else:
        key_data = jax.random.key_data(key)
    return {
        "step": state.step,
        "updates": state.updates,
        "variables": state.variables,
        "opt_state": state.opt_state,
        "ema": state.ema,
        "key": key_data,
    }


def _from_storable(tree: dict[str, Any], abstract: TrainState) -> TrainState:
    return TrainState(
        step=tree["step"],
        updates=tree["updates"],
        variables=tree["variables"],
        opt_state=tree["opt_state"],
        ema=tree["ema"],
        key=jax.random.wrap_key_data(tree["key"]),
    )


def _encode_position(position: Any) -> Any:
    """Iterator states are JSON when they can be, else base64 of their pickle."""
    if position is None:
        return None
    try:
        import json

        json.dumps(position)
        return {"json": position}
    except (TypeError, ValueError):
        return {"pickle": base64.b64encode(pickle.dumps(position)).decode("ascii")}


def _decode_position(encoded: Any) -> Any:
    if encoded is None:
        return None
    if "json" in encoded:
        return encoded["json"]
    return pickle.loads(base64.b64decode(encoded["pickle"]))
