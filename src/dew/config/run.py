"""Run records: what rebuilds a run without the script that made it.

A saved run is a directory holding `run.json` beside its checkpoint steps. `run.json` names the
model class by import path with its constructor settings, the objective with its settings, the
tokenizer (its files are copied into the run), the sampling defaults, and the data and optimizer
settings. `RunConfig.save` writes it; `dew.pipeline(run)` and `dew export` read it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from dew.config.records import from_record, import_path, resolve, to_record
from dew.files import staged_directory, write_atomic
from dew.objectives import run_record

RUN_FILE = "run.json"
FORMAT = "dew.run"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A model class by import path and the settings its constructor takes."""

    target: str
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_model(cls, model: Any) -> ModelConfig:
        record = to_record(model)
        if not isinstance(record, dict) or "__type__" not in record:
            raise TypeError(f"ModelConfig.from_model needs a Flax module (a dataclass); got {model!r}.")
        return cls(target=record["__type__"], settings=record["fields"])

    def build(self) -> Any:
        return resolve(self.target)(**from_record(self.settings))


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """An objective class by import path and its settings beside the model (seq_len, ema_decay...)."""

    target: str
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_objective(cls, objective: Any) -> ObjectiveConfig:
        settings = objective.settings() if callable(getattr(objective, "settings", None)) else {}
        return cls(target=import_path(objective), settings=to_record(settings))

    def build(self, model: Any) -> Any:
        return resolve(self.target)(model, **from_record(self.settings))


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """An Optax optimizer by name, with a linear warm-up and an optional cosine decay."""

    optimizer: str = "adamw"
    """One of adam, adamw, sgd, lion."""
    learning_rate: float = 1e-3
    """The peak rate, reached after the warm-up."""
    weight_decay: float = 0.0
    """Decoupled weight decay (adamw, lion)."""
    b1: float = 0.9
    """First-moment decay (adam, adamw, lion)."""
    b2: float = 0.999
    """Second-moment decay (adam, adamw, lion)."""
    momentum: float | None = None
    """Momentum for sgd (None: plain sgd)."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0."""
    decay_steps: int | None = None
    """Steps to a cosine decay to 0 (None: the rate stays at its peak)."""
    clip_norm: float | None = None
    """Clip the global gradient norm to this (None: no clipping)."""

    OPTIMIZERS = ("adam", "adamw", "sgd", "lion")

    def __post_init__(self):
        if self.optimizer not in self.OPTIMIZERS:
            raise ValueError(
                f"OptimConfig.optimizer must be one of {self.OPTIMIZERS}; got {self.optimizer!r}."
            )

    def schedule(self):
        import optax

        if self.decay_steps is not None:
            return optax.warmup_cosine_decay_schedule(
                0.0, self.learning_rate, self.warmup_steps, max(self.decay_steps, self.warmup_steps + 1)
            )
        if self.warmup_steps:
            return optax.linear_schedule(0.0, self.learning_rate, self.warmup_steps)
        return self.learning_rate

    def build(self):
        import optax

        rate = self.schedule()
        if self.optimizer == "adam":
            optimizer = optax.adam(rate, b1=self.b1, b2=self.b2)
        elif self.optimizer == "adamw":
            optimizer = optax.adamw(rate, b1=self.b1, b2=self.b2, weight_decay=self.weight_decay)
        elif self.optimizer == "lion":
            optimizer = optax.lion(rate, b1=self.b1, b2=self.b2, weight_decay=self.weight_decay)
        else:
            optimizer = optax.sgd(rate, momentum=self.momentum)
        if self.clip_norm is not None:
            optimizer = optax.chain(optax.clip_by_global_norm(self.clip_norm), optimizer)
        return optimizer


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Run settings: where checkpoints go, how long, how often."""

    name: str | None = None
    """The run's directory under checkpoint_dir (RunConfig.train)."""
    checkpoint_dir: str = "runs/run"
    """Where runs are written."""
    steps: int = 1000
    """The step to train to (an absolute target: a resumed run trains the rest)."""
    batch_size: int = 32
    """Rows in each global batch."""
    log_every: int = 100
    """Steps between progress reports."""
    eval_every: int | None = None
    """Steps between validation passes (None: none)."""
    checkpoint_every: int | None = None
    """Steps between checkpoints (None: only the last step)."""
    keep: int | None = 2
    """Checkpoint steps kept (None keeps all)."""
    seed: int = 0
    """The root key of initialization and every step's randomness."""
    accumulation: int = 1
    """Microbatches per step whose gradients are averaged."""
    xla_flags: tuple[str, ...] = ()
    """Flags appended to XLA_FLAGS before the backend starts (a command line writes
    --trainer.xla-flags=--xla_gpu_deterministic_ops=true)."""

    def apply_xla_flags(self) -> None:
        """Append `xla_flags` to the XLA_FLAGS environment variable, before JAX starts its backend.

        XLA reads XLA_FLAGS once, when the first computation starts the backend, so a flag set later
        would be silently ignored: that raises instead. Flags already in XLA_FLAGS are not repeated.
        """
        present = os.environ.get("XLA_FLAGS", "").split()
        missing = [flag for flag in self.xla_flags if flag not in present]
        if not missing:
            return
        if _backend_started():
            raise RuntimeError(
                f"TrainerConfig.xla_flags {missing} must reach XLA_FLAGS before JAX starts its backend, "
                "but this process has already run a JAX computation. Call "
                "config.trainer.apply_xla_flags() at the top of the program (before any jax call), "
                "or set XLA_FLAGS in the environment that starts it."
            )
        os.environ["XLA_FLAGS"] = " ".join(present + missing)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything `run.json` records about a run."""

    model: ModelConfig
    data: Any = None
    optim: OptimConfig = OptimConfig()
    trainer: TrainerConfig = TrainerConfig()
    objective: ObjectiveConfig | None = None
    tokenizer: str | None = None
    sampling: Any = None

    def record(self) -> dict[str, Any]:
        """The JSON-ready form `run.json` holds."""
        record = {"format": FORMAT, "version": 1}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _PLAIN and value is not None:  # Dew's own records: fields without a type tag
                record[field.name] = {f.name: to_record(getattr(value, f.name)) for f in dataclasses.fields(value)}
            else:
                record[field.name] = to_record(value)
        return record

    def save(self, directory: str | os.PathLike, *, tokenizer: Any = None) -> Path:
        """Write `run.json` into `directory` (atomically), copying a tokenizer's files beside it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = self
        if tokenizer is not None:
            config = dataclasses.replace(config, tokenizer=_store_tokenizer(tokenizer, directory))
        return write_atomic(directory / RUN_FILE, json.dumps(config.record(), indent=2) + "\n")

    def train(
        self,
        objective: Any,
        data: Any = None,
        *,
        name: str | None = None,
        tracker: Any = None,
        metrics: Any = (),
        tokenizer: Any = None,
    ) -> Any:
        """Train `objective` as this run under `trainer.checkpoint_dir/name` and return the final state.

        run.json is written first, so a stopped run is already a run; the run is tracked by `tracker`
        (a LocalTracker in `<run>/tracking` by default) and ends with a checkpoint of its last step,
        so `dew.pipeline(<run>)` reloads it. `data` is a `dew.Dataset` (default: `self.data.load(
        batch=trainer.batch_size)`); `name` defaults to `trainer.name` (no name trains in
        `checkpoint_dir` itself). Calling train again on the same directory resumes from its newest
        checkpoint.
        """
        from dew.config.train import train_run

        return train_run(self, objective, data, name=name, tracker=tracker, metrics=metrics, tokenizer=tokenizer)

    def describing(self, objective: Any, name: str | None) -> RunConfig:
        """The config run.json records for training `objective` as the run `name`: the objective filled
        in when this config names none, and `trainer.name` set.

        A config that names a different model or objective than the one trained would make run.json
        rebuild something else, so that raises.
        """
        model = getattr(objective, "model", None)
        if model is None:
            raise TypeError(f"RunConfig.train needs an objective with a .model; got {type(objective).__name__}.")
        trained = ModelConfig.from_model(model)
        if ModelConfig.from_model(self.model.build()) != trained:
            raise ValueError(
                f"The RunConfig records the model {self.model.target} with {self.model.settings}, but the "
                f"objective trains {trained.target} with {trained.settings}. Build the objective from the "
                "config (run.model.build()) or record its model with ModelConfig.from_model(objective.model)."
            )
        described = ObjectiveConfig.from_objective(objective)
        if self.objective is not None and (
            self.objective.target != described.target or to_record(self.objective.settings) != described.settings
        ):
            raise ValueError(
                f"The RunConfig records the objective {self.objective.target} with {self.objective.settings}, "
                f"but the objective trained is {described.target} with {described.settings}. Pass the objective "
                "the config describes, or leave RunConfig.objective unset so train records it."
            )
        return dataclasses.replace(
            self,
            objective=described if self.objective is None else self.objective,
            trainer=dataclasses.replace(self.trainer, name=name),
        )

    def sweep(self, space: Any, *, train: Any, trials: int | None = None, ledger: Any = None,
              tracker: Any = None, search: Any = None, retry_failed: bool = False) -> list[Any]:
        """Train one trial of this run for each point of `space`; see `dew.config.sweep.sweep`."""
        from dew.config.sweep import sweep

        return sweep(self, space, train=train, trials=trials, ledger=ledger, tracker=tracker, search=search,
                     retry_failed=retry_failed)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> RunConfig:
        path = Path(directory) / RUN_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{directory} holds no {RUN_FILE}; a saved run is a directory written by "
                "RunConfig.save (or dew demo) beside its checkpoints."
            )
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("format") != FORMAT:
            raise ValueError(f"{path} is not a Dew run record (format {record.get('format')!r}).")
        values = {}
        for field in dataclasses.fields(cls):
            raw = record.get(field.name)
            if field.name in _PLAIN and raw is not None:
                kind = _PLAIN[field.name]
                # settings stay records: the model and objective rebuild them when built
                keep = ("settings",)
                values[field.name] = kind(**{k: (v if k in keep else from_record(v)) for k, v in raw.items()})
            else:
                values[field.name] = from_record(raw)
        if values["model"] is None:
            raise ValueError(f"{path} records no model.")
        return cls(**{k: v for k, v in values.items() if v is not None or k not in ("optim", "trainer")})

    def tokenizer_in(self, directory: str | os.PathLike):
        """The run's tokenizer, rebuilt from the files stored in the run directory (or None)."""
        if self.tokenizer is None:
            return None
        from dew.data.tokenizers import load_tokenizer

        if self.tokenizer == "byte":
            return load_tokenizer("byte")
        return load_tokenizer(Path(directory) / self.tokenizer)


_PLAIN = {"model": ModelConfig, "optim": OptimConfig, "trainer": TrainerConfig, "objective": ObjectiveConfig}


def _write_described_run(directory, *, model, data, optim, trainer, objective_class, objective_settings,
                         sampling) -> Path:
    """run.json for a run described in objective terms (DiffusionRunConfig.save), as RunConfig writes it."""
    config = RunConfig(model=model, data=data, optim=OptimConfig() if optim is None else optim,
                       trainer=TrainerConfig() if trainer is None else trainer,
                       objective=ObjectiveConfig(target=import_path(objective_class),
                                                 settings=to_record(objective_settings)),
                       sampling=sampling)
    return config.save(directory)


run_record.install(_write_described_run)


def _backend_started() -> bool:
    """Whether JAX has started a backend in this process (and so has read XLA_FLAGS)."""
    import jax._src.xla_bridge as xla_bridge  # the one place JAX says so; no public API exists

    return bool(xla_bridge.backends_are_initialized())


def _store_tokenizer(tokenizer: Any, directory: Path) -> str:
    from dew.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(tokenizer)
    if tokenizer.describe() == "byte":
        return "byte"
    with staged_directory(directory / "tokenizer") as staging:
        tokenizer.save(staging)
    return "tokenizer"
