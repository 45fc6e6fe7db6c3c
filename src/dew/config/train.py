"""Training a RunConfig: the run directory, its run.json, its tracker and its final checkpoint.

`RunConfig.train` lands here. The run record is written before the first step, so an interrupted
run is still a run that says what it was; the last step is always checkpointed, so a finished run
reloads with `dew.pipeline` whatever `checkpoint_every` was. The functions take the RunConfig as
an argument rather than importing run.py, which calls them.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

import jax

from dew.data.dataset import Dataset
from dew.tracking.local import LocalTracker
from dew.training.checkpoints import Checkpoints
from dew.training.trainer import Trainer


def run_directory(trainer: Any, name: str | None) -> Path:
    """`trainer.checkpoint_dir/name` (or `checkpoint_dir` itself when there is no name)."""
    if name is None:
        return Path(trainer.checkpoint_dir)
    if not isinstance(name, str) or not name or PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts:
        raise ValueError(
            f"A run name is a relative directory name under trainer.checkpoint_dir, like 'lm-rate'; got {name!r}."
        )
    return Path(trainer.checkpoint_dir) / name


def training_data(config: Any, data: Any) -> Any:
    """The Dataset to train on: `data`, or the one `config.data` loads at `trainer.batch_size`."""
    batch = config.trainer.batch_size
    if data is None:
        if not callable(getattr(config.data, "load", None)):
            raise ValueError(
                f"RunConfig.train got no data and RunConfig.data ({type(config.data).__name__}) cannot load "
                "one (it has no load(batch=)). Pass train(objective, data) a dew.Dataset."
            )
        return config.data.load(batch=batch)
    if not isinstance(data, Dataset):
        raise TypeError(f"RunConfig.train takes data as a dew.Dataset; got {type(data).__name__}.")
    if data.batch != batch:
        raise ValueError(
            f"The dataset yields global batches of {data.batch} rows but trainer.batch_size is {batch}; the "
            f"run would record a batch it did not train on. Set TrainerConfig(batch_size={data.batch}) or "
            "load the data at the recorded batch size."
        )
    return data


def train_run(
    config: Any,
    objective: Any,
    data: Any = None,
    *,
    name: str | None = None,
    tracker: Any = None,
    metrics: Any = (),
    tokenizer: Any = None,
) -> Any:
    """See `RunConfig.train`."""
    config.trainer.apply_xla_flags()
    name = config.trainer.name if name is None else name
    directory = run_directory(config.trainer, name)
    recorded = config.describing(objective, name)
    dataset = training_data(config, data)
    recorded.save(directory, tokenizer=tokenizer if tokenizer is not None else getattr(objective, "tokenizer", None))
    settings = config.trainer
    checkpoints = Checkpoints(directory, keep=settings.keep)
    own_tracker = tracker is None
    if own_tracker:
        tracker = LocalTracker(directory / "tracking", plots=False)
    try:
        trainer = Trainer(objective, config.optim.build(), key=jax.random.key(settings.seed),
                          accumulation=settings.accumulation, checkpoints=checkpoints, tracker=tracker)
        state = trainer.fit(dataset, steps=settings.steps, log_every=settings.log_every,
                            eval_every=settings.eval_every, checkpoint_every=settings.checkpoint_every,
                            metrics=metrics)
        if checkpoints.latest() != int(state.step):
            # The last step is always kept; without checkpoint_every it has no data position to record.
            checkpoints.save(state)
        checkpoints.wait()
    finally:
        if own_tracker:
            tracker.close()
    return state
