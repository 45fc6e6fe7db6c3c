"""Hyperparameter sweeps: one real run per point of a search space, kept in a resumable ledger.

`RunConfig.sweep(space, train=, trials=, ledger=, tracker=, search=)` runs `train(run)` for each
trial, where `run` is the config with the trial's overrides applied and its trainer pointed at
`<checkpoint_dir>/<name>/trial-<index>`; `train` returns the trial's score (usually after
`run.train(...)`). The JSON ledger is rewritten atomically when a trial starts and when it ends, and
a finished trial reaches the ledger before the tracker, so calling `sweep` again skips every finished
trial and reruns only the rest. A trial that raises is recorded as failed and the sweep goes on.

A space maps setting paths to a list of values, or (for RandomSearch and OptunaSearch) to a range:
`{"optim.learning_rate": Uniform(1e-4, 1e-1, log=True), "trainer.batch_size": [8, 16]}`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import numbers
import os
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dew import checks
from dew.config.overrides import apply_overrides, check_value, override
from dew.config.records import from_record, import_path, to_record
from dew.files import write_atomic
from dew.tracking.records import SweepTrial

LEDGER_FORMAT = "dew.sweep"


# --- the space -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Uniform:
    """Floats drawn uniformly from [low, high], or log-uniformly with `log=True` (for rates)."""

    low: float
    high: float
    log: bool = False

    def __post_init__(self):
        if not (_real(self.low) and _real(self.high)) or not self.low < self.high:
            raise ValueError(f"Uniform needs real numbers low < high; got low={self.low!r}, high={self.high!r}.")
        if self.log and self.low <= 0:
            raise ValueError(f"Uniform(log=True) needs low > 0; got low={self.low!r}.")


@dataclasses.dataclass(frozen=True)
class IntRange:
    """Integers drawn uniformly from low to high, both included."""

    low: int
    high: int

    def __post_init__(self):
        checks.count(self.low, "IntRange.low", minimum=-(2**62))
        checks.count(self.high, "IntRange.high", minimum=-(2**62))
        if not self.low <= self.high:
            raise ValueError(f"IntRange needs low <= high; got low={self.low}, high={self.high}.")


Dimension = Sequence[Any] | Uniform | IntRange


def check_space(config: Any, space: Mapping[str, Any]) -> dict[str, Any]:
    """The space with each dimension checked against the setting it overrides, lists as tuples."""
    if not isinstance(space, Mapping) or not space:
        raise ValueError(
            "A sweep needs a non-empty space mapping setting paths to values, like "
            f"{{'optim.learning_rate': [0.01, 0.003]}}; got {space!r}."
        )
    checked: dict[str, Any] = {}
    for path, dimension in space.items():
        if path in ("trainer.name", "trainer.checkpoint_dir"):
            raise ValueError(f"A sweep places each trial's run itself (<checkpoint_dir>/<name>/trial-<i>); {path} cannot be swept.")
        if isinstance(dimension, (Uniform, IntRange)):
            draw = float if isinstance(dimension, Uniform) else int  # the type of what the range yields
            check_value(config, path, draw(dimension.low))
            checked[path] = dimension
            continue
        if isinstance(dimension, (str, bytes)) or not isinstance(dimension, Sequence):
            raise TypeError(
                f"The space gives {path!r} {dimension!r}; a dimension is a list of values, a Uniform or an IntRange."
            )
        values = tuple(dimension)
        if not values:
            raise ValueError(f"The space gives {path!r} no values; list at least one.")
        kinds = {_kind(value) for value in values}
        if len(kinds) > 1:
            raise TypeError(
                f"The space gives {path!r} values of mixed types {sorted(kinds)}: {list(values)}. "
                "Every value of one setting has the same type."
            )
        for value in values:
            override(config, path, value)  # the type, and whatever the setting's own class checks
        checked[path] = values
    return checked


# --- searches --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GridSearch:
    """Every combination of the listed values, in order (the last path varies fastest)."""

    def start(self, space: dict[str, Any], done: Sequence[Trial]) -> _Proposer:
        return _Grid(list(itertools.product(*space.values())), list(space))

    def size(self, space: dict[str, Any]) -> int | None:
        """The number of points; raises for a range, which a grid cannot enumerate."""
        ranges = [path for path, dimension in space.items() if not isinstance(dimension, tuple)]
        if ranges:
            raise TypeError(f"GridSearch takes lists of values; {ranges} are ranges. Use RandomSearch or OptunaSearch.")
        return math.prod(len(values) for values in space.values())

    def identity(self) -> Any:
        return to_record(self)


@dataclasses.dataclass(frozen=True)
class RandomSearch:
    """Independent draws: trial `i` draws from `(seed, i)`, so a resumed sweep proposes the same points."""

    seed: int = 0

    def start(self, space: dict[str, Any], done: Sequence[Trial]) -> _Proposer:
        return _Random(space, self.seed)

    def size(self, space: dict[str, Any]) -> int | None:
        return None

    def identity(self) -> Any:
        return to_record(self)


@dataclasses.dataclass(frozen=True)
class OptunaSearch:
    """Points proposed by an Optuna sampler (TPE from `seed` by default) that learns from the finished trials.

    `direction` is "minimize" or "maximize" the value `train` returns. A resumed sweep tells the
    sampler every trial in the ledger before it asks for the next. Needs the `hpo` extra (optuna).
    """

    direction: str = "minimize"
    seed: int = 0
    sampler: Any = None

    def __post_init__(self):
        if self.direction not in ("minimize", "maximize"):
            raise ValueError(f"OptunaSearch.direction is 'minimize' or 'maximize'; got {self.direction!r}.")

    def start(self, space: dict[str, Any], done: Sequence[Trial]) -> _Proposer:
        try:
            import optuna
        except ImportError as error:
            raise ImportError("OptunaSearch needs optuna: pip install 'dewml[hpo]'.") from error
        return _Optuna(optuna, space, self, done)

    def size(self, space: dict[str, Any]) -> int | None:
        return None

    def identity(self) -> Any:
        sampler = None if self.sampler is None else import_path(type(self.sampler))
        return {"search": import_path(type(self)), "direction": self.direction, "seed": self.seed, "sampler": sampler}


class _Proposer:
    """One sweep's source of points: `propose(index, fixed)` and `tell(trial)`."""

    def propose(self, index: int, fixed: dict[str, Any] | None) -> dict[str, Any]:
        raise NotImplementedError

    def tell(self, trial: Trial) -> None:
        pass


class _Grid(_Proposer):
    def __init__(self, points: list[tuple], paths: list[str]):
        self.points, self.paths = points, paths

    def propose(self, index, fixed):
        return dict(zip(self.paths, self.points[index]))


class _Random(_Proposer):
    def __init__(self, space: dict[str, Any], seed: int):
        self.space, self.seed = space, seed

    def propose(self, index, fixed):
        rng = np.random.default_rng([self.seed, index])
        point = {}
        for path, dimension in self.space.items():
            if isinstance(dimension, Uniform):
                if dimension.log:
                    value = math.exp(rng.uniform(math.log(dimension.low), math.log(dimension.high)))
                else:
                    value = rng.uniform(dimension.low, dimension.high)
                point[path] = float(value)
            elif isinstance(dimension, IntRange):
                point[path] = int(rng.integers(dimension.low, dimension.high, endpoint=True))
            else:
                point[path] = dimension[int(rng.integers(len(dimension)))]
        return point


class _Optuna(_Proposer):
    def __init__(self, optuna: Any, space: dict[str, Any], search: OptunaSearch, done: Sequence[Trial]):
        self.optuna = optuna
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        distributions = optuna.distributions
        self.distributions = {}
        self.choices: dict[str, tuple] = {}
        for path, dimension in space.items():
            if isinstance(dimension, Uniform):
                self.distributions[path] = distributions.FloatDistribution(dimension.low, dimension.high, log=dimension.log)
            elif isinstance(dimension, IntRange):
                self.distributions[path] = distributions.IntDistribution(dimension.low, dimension.high)
            else:
                # Optuna's categories must be plain JSON values; the ledger keeps the real ones.
                self.choices[path] = dimension
                self.distributions[path] = distributions.CategoricalDistribution(list(range(len(dimension))))
        sampler = search.sampler if search.sampler is not None else optuna.samplers.TPESampler(seed=search.seed)
        self.study = optuna.create_study(direction=search.direction, sampler=sampler)
        self.asked: dict[int, Any] = {}
        for trial in done:
            state = optuna.trial.TrialState.COMPLETE if trial.status == "finished" else optuna.trial.TrialState.FAIL
            self.study.add_trial(optuna.trial.create_trial(
                params=self._params(trial.overrides), distributions=self.distributions, state=state,
                value=trial.value if trial.status == "finished" else None,
            ))

    def _params(self, overrides: dict[str, Any]) -> dict[str, Any]:
        return {path: self.choices[path].index(value) if path in self.choices else value
                for path, value in overrides.items()}

    def propose(self, index, fixed):
        if fixed is not None:
            self.study.enqueue_trial(self._params(fixed))
        asked = self.study.ask(self.distributions)
        self.asked[index] = asked
        return {path: self.choices[path][value] if path in self.choices else value
                for path, value in asked.params.items()}

    def tell(self, trial):
        asked = self.asked.pop(trial.index, None)
        if asked is None:
            return
        if trial.status == "finished":
            self.study.tell(asked, trial.value)
        else:
            self.study.tell(asked, state=self.optuna.trial.TrialState.FAIL)


# --- trials and the ledger -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Trial:
    """One point of a sweep: its overrides, where it ran, and how it ended.

    `status` is "running" (started, not ended: an interrupted trial), "finished" (with `value`) or
    "failed" (with `error`).
    """

    index: int
    overrides: dict[str, Any]
    status: str
    directory: str
    value: float | None = None
    error: str | None = None
    seconds: float | None = None

    def report(self) -> SweepTrial:
        return SweepTrial(index=self.index, params=self.overrides, status=self.status, metric=self.value,
                          message=self.error, directory=self.directory)


class Ledger:
    """The JSON file that says what a sweep is and how each of its trials went."""

    def __init__(self, path: Path, identity: dict[str, Any], trials: dict[int, Trial]):
        self.path, self.identity, self.trials = path, identity, trials

    @classmethod
    def open(cls, path: str | os.PathLike, identity: dict[str, Any]) -> Ledger:
        """The ledger at `path` (a new one when there is none); refuses one written by another sweep."""
        path = Path(path)
        identity = json.loads(json.dumps(identity))
        if not path.exists():
            return cls(path, identity, {})
        stored = cls.read(path)
        if stored.identity != identity:
            differs = [part for part in identity if stored.identity.get(part) != identity[part]]
            raise ValueError(
                f"The ledger {path} belongs to a different sweep (its {', '.join(differs)} differ), so its "
                "trials say nothing about this one. Give this sweep its own ledger= path, or delete the "
                "file to start over."
            )
        return stored

    @classmethod
    def read(cls, path: str | os.PathLike) -> Ledger:
        path = Path(path)
        record = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(record, dict) or record.get("format") != LEDGER_FORMAT:
            raise ValueError(f"{path} is not a Dew sweep ledger (format {record.get('format')!r}).")
        trials = {int(row["index"]): Trial(**{**row, "overrides": from_record(row["overrides"])})
                  for row in record["trials"]}
        return cls(path, record["sweep"], trials)

    def write(self, trial: Trial) -> None:
        """Record `trial` and rewrite the whole file atomically."""
        self.trials[trial.index] = trial
        rows = [{**dataclasses.asdict(self.trials[index]), "overrides": to_record(self.trials[index].overrides)}
                for index in sorted(self.trials)]
        record = {"format": LEDGER_FORMAT, "version": 1, "sweep": self.identity, "trials": rows}
        write_atomic(self.path, json.dumps(record, indent=2) + "\n")


# --- the sweep -------------------------------------------------------------------------------------


def sweep(
    config: Any,
    space: Mapping[str, Dimension],
    *,
    train: Callable[[Any], float],
    trials: int | None = None,
    ledger: str | os.PathLike | None = None,
    tracker: Any = None,
    search: Any = None,
    retry_failed: bool = False,
) -> list[Trial]:
    """Run `train(run)` for `trials` points of `space` and return the finished trials in index order.

    Trial `i` trains under `<checkpoint_dir>/<trainer.name or 'sweep'>/trial-<i>`. The ledger
    (default `ledger.json` beside the trials) is what makes the sweep resumable: finished trials in
    it are not trained again, nor failed ones unless `retry_failed`. GridSearch's `trials` defaults
    to the whole grid; the other searches need it.
    """
    if not callable(train):
        raise TypeError(f"sweep(train=) is called as train(run) -> value; got {type(train).__name__}.")
    search = GridSearch() if search is None else search
    if not all(callable(getattr(search, method, None)) for method in ("start", "size", "identity")):
        raise TypeError(f"search must be GridSearch(), RandomSearch(seed=) or OptunaSearch(...); got {search!r}.")
    space = check_space(config, space)
    size = search.size(space)
    if trials is None:
        if size is None:
            raise ValueError(f"{type(search).__name__} draws without end: pass sweep(..., trials=N).")
        trials = size
    trials = checks.count(trials, "sweep trials")
    if size is not None and trials > size:
        raise ValueError(f"The grid has {size} points but trials={trials}; pass trials <= {size} or widen the space.")

    root = Path(config.trainer.checkpoint_dir) / (config.trainer.name or "sweep")
    identity = {"config": config.record(), "space": to_record(space), "search": search.identity()}
    book = Ledger.open(root / "ledger.json" if ledger is None else ledger, identity)
    done = [trial for trial in book.trials.values() if trial.status == "finished"
            or (trial.status == "failed" and not retry_failed)]
    proposer = search.start(space, sorted(done, key=lambda trial: trial.index))
    kept = {trial.index for trial in done}

    for index in range(trials):
        if index in kept:
            continue
        previous = book.trials.get(index)
        overrides = proposer.propose(index, None if previous is None else previous.overrides)
        run = _trial_config(config, overrides, root, index)
        directory = str(root / f"trial-{index}")
        book.write(Trial(index=index, overrides=overrides, status="running", directory=directory))
        started = time.perf_counter()
        try:
            value = _score(train(run))
            trial = Trial(index=index, overrides=overrides, status="finished", directory=directory, value=value)
        except Exception as error:
            message = "".join(traceback.format_exception_only(type(error), error)).strip()
            trial = Trial(index=index, overrides=overrides, status="failed", directory=directory, error=message)
            warnings.warn(f"Sweep trial {index} ({overrides}) failed: {message}", stacklevel=2)
        trial = dataclasses.replace(trial, seconds=round(time.perf_counter() - started, 3))
        book.write(trial)  # on disk before anyone is told
        proposer.tell(trial)
        if tracker is not None:
            tracker.log(trial.report())
            if trial.status == "finished":
                tracker.log({"sweep/value": trial.value}, step=index)
    return [book.trials[index] for index in range(trials) if book.trials[index].status == "finished"]


def _trial_config(config: Any, overrides: dict[str, Any], root: Path, index: int) -> Any:
    run = apply_overrides(config, overrides)
    trainer = dataclasses.replace(run.trainer, checkpoint_dir=str(root), name=f"trial-{index}")
    return dataclasses.replace(run, trainer=trainer)


def _score(value: Any) -> float:
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if not _real(value) or not math.isfinite(float(value)):
        raise ValueError(f"A sweep's train(run) returns a finite number (the trial's score); it returned {value!r}.")
    return float(value)


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    """A value's type for the mixed-type check; ints and floats count as one kind (numbers)."""
    return "number" if _real(value) else type(value).__name__
