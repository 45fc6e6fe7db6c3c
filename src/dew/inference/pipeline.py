"""`dew.pipeline`: an inference task from a saved run or a local checkpoint directory."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any


def pipeline(
    source: str | os.PathLike,
    *,
    step: int | None = None,
    averaged: bool = True,
    sampling: Any = None,
    **load_options: Any,
):
    """The task a run or checkpoint directory supports (text generation for a decoder).

    `source` is a saved run (a directory with `run.json` beside its checkpoint steps: the model is
    rebuilt from the record and the weights of `step`, the latest by default, are loaded, with the
    EMA copy when `averaged` and the run kept one) or a Hugging Face layout directory (config.json
    and safetensors weights; `load_options` such as `dtype=` go to its loader). Nothing is
    downloaded: a name that is not a local directory is an error.
    """
    path = Path(source)
    if (path / "run.json").is_file():
        return _from_run(path, step=step, averaged=averaged, sampling=sampling)
    if (path / "config.json").is_file():
        from dew.interop import Pretrained

        task = Pretrained.load(path, **load_options).text_generation()
        return dataclasses.replace(task, sampling=sampling) if sampling is not None else task
    raise FileNotFoundError(
        f"{source!s} is neither a saved run (a directory with run.json) nor a checkpoint directory "
        "(with config.json). Dew downloads nothing: pass a local directory."
    )


def _from_run(path: Path, *, step: int | None, averaged: bool, sampling: Any):
    import jax.numpy as jnp

    from dew.config.run import RunConfig
    from dew.training.checkpoints import Checkpoints
    from dew.training.state import TrainState

    config = RunConfig.load(path)
    if config.objective is None:
        raise ValueError(f"{path / 'run.json'} names no objective, so it does not say which task it serves.")
    model = config.model.build()
    variables, ema, found = Checkpoints(path).restore_variables(step)
    state = TrainState(
        step=jnp.asarray(found, jnp.int32),
        updates=jnp.asarray(found, jnp.int32),
        variables=variables,
        opt_state=None,
        ema=ema if averaged else None,
        key=None,
    )
    task = config.objective.build(model).pipeline(state)
    replacements = {}
    tokenizer = config.tokenizer_in(path)
    if tokenizer is not None and hasattr(task, "tokenizer"):
        replacements["tokenizer"] = tokenizer
    chosen = sampling if sampling is not None else config.sampling
    if chosen is not None and hasattr(task, "sampling"):
        replacements["sampling"] = chosen
    return dataclasses.replace(task, **replacements) if replacements else task
