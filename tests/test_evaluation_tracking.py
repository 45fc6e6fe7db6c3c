"""Validation passes, metrics over a whole pass, previews, and the local tracker."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Aux, Dataset, Evaluation, LocalTracker, Trackers, Trainer
from dew.tracking import Artifact, Tracker
from test_trainer import Linear, linear_data


@dataclasses.dataclass(frozen=True)
class SumOfSquares:
    """A pass-level metric: total squared error over every row, not a mean of batch means."""

    name: str = "sse"

    def empty(self):
        return 0.0

    def update(self, total, outputs):
        return total + float(outputs["squared_error"].sum())

    def result(self, total):
        return {"sse": total}


class Scored(Linear):
    def evaluate(self, variables, batch, step):
        error = self.model.apply(variables, batch["x"]) - batch["y"]
        return {"loss": jnp.mean(error**2), "squared_error": error[:, 0] ** 2}

    def preview(self, variables, key, step):
        return [Artifact("weights", "text", f"step {step}: {np.asarray(variables['params']['kernel']).ravel()}")]


def split_data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 3)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True).astype(np.float32)
    return Dataset.from_records({"x": x[:24], "y": y[:24]}, batch=8, validation={"x": x[24:], "y": y[24:]})


def test_evaluation_scores_the_whole_validation_pass():
    objective = Scored()
    variables = objective.init(jax.random.key(0))
    data = split_data()
    result = Evaluation.run(objective, variables, data.val, metrics=(SumOfSquares(),), key=jax.random.key(1), step=3)
    batches = list(data.val(__import__("dew").data.Partition()))
    assert [len(b["x"]) for b in batches] == [8, 8]
    errors = np.concatenate(
        [np.asarray(objective.model.apply(variables, b["x"]) - b["y"])[:, 0] for b in batches]
    )
    assert result.scores["val/sse"] == pytest.approx(float((errors**2).sum()), rel=1e-5)
    assert result.scores["val/loss"] == pytest.approx(float((errors**2).mean()), rel=1e-5)
    assert result.step == 3 and result.previews == []


def test_a_short_last_batch_is_weighted_by_its_rows():
    objective = Scored()
    variables = objective.init(jax.random.key(0))
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(10, 3)).astype(np.float32), rng.normal(size=(10, 1)).astype(np.float32)
    data = Dataset.from_records({"x": x, "y": y}, batch=8, validation={"x": x, "y": y})
    result = Evaluation.run(objective, variables, data.val, key=jax.random.key(1))
    error = np.asarray(objective.model.apply(variables, x) - y)
    assert result.scores["val/loss"] == pytest.approx(float((error**2).mean()), rel=1e-5)


def test_fit_evaluates_at_eval_every_with_the_averaged_weights_and_logs_previews(tmp_path):
    objective = Scored(ema_decay=0.5)
    with LocalTracker(tmp_path / "track", plots=True) as tracker:
        trainer = Trainer(objective, optax.sgd(0.05), key=jax.random.key(0), tracker=tracker)
        state = trainer.fit(split_data(), steps=6, log_every=2, eval_every=3, metrics=(SumOfSquares(),), preview=True)
    assert [r.step for r in trainer.evaluations] == [3, 6]
    final = Evaluation.run(objective, state.averaged, split_data().val, metrics=(SumOfSquares(),), key=jax.random.key(1))
    assert trainer.evaluations[-1].scores["val/sse"] == pytest.approx(final.scores["val/sse"], rel=1e-6)
    live = Evaluation.run(objective, state.variables, split_data().val, metrics=(SumOfSquares(),), key=jax.random.key(1))
    assert live.scores["val/sse"] != pytest.approx(final.scores["val/sse"], rel=1e-6)

    rows = [json.loads(line) for line in (tmp_path / "track" / "scalars.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [2, 4, 6]
    assert [r["step"] for r in rows if "val/sse" in r] == [3, 6]
    records = [json.loads(line)["record"] for line in (tmp_path / "track" / "records.jsonl").read_text().splitlines()]
    assert records[0] == "RunStarted" and "Progress" in records and "_ArtifactWritten" in records
    assert (tmp_path / "track" / "artifacts" / "weights-00000006.txt").read_text().startswith("step 6:")
    plots = sorted(p.name for p in (tmp_path / "track" / "plots").iterdir())
    assert "train_loss.png" in plots and "val_sse.png" in plots


def test_trackers_fan_out_and_local_tracker_writes_images(tmp_path):
    class Memory(Tracker):
        def __init__(self):
            self.logged, self.artifacts, self.closed = [], [], False

        def log(self, data, step=None):
            self.logged.append((data, step))

        def artifact(self, artifact, step=None):
            self.artifacts.append(artifact.name)

        def close(self):
            self.closed = True

    memory = Memory()
    local = LocalTracker(tmp_path / "local", plots=False)
    with Trackers(local, memory) as both:
        both.log({"a": 1.0}, step=1)
        both.artifact(Artifact("grid", "image", np.zeros((4, 4, 3), np.uint8)), step=1)
    assert memory.logged[0] == ({"a": 1.0}, 1) and memory.artifacts == ["grid"] and memory.closed
    assert (tmp_path / "local" / "artifacts" / "grid-00000001.png").exists()
    assert not (tmp_path / "local" / "plots").exists()
    with pytest.raises(RuntimeError, match="closed"):
        local.log({"a": 2.0}, step=2)
    with pytest.raises(TypeError, match="not a tracker"):
        Trackers(object())


def test_a_failure_reaches_the_tracker_as_a_typed_record(tmp_path):
    from test_trainer import Exploding

    with LocalTracker(tmp_path / "track", plots=False) as tracker:
        with pytest.raises(FloatingPointError):
            Trainer(Exploding(), optax.sgd(0.1), key=jax.random.key(0), tracker=tracker).fit(linear_data(), steps=8)
    records = [json.loads(line) for line in (tmp_path / "track" / "records.jsonl").read_text().splitlines()]
    failure = [r for r in records if r["record"] == "Failure"]
    assert len(failure) == 1 and failure[0]["step"] == 5 and failure[0]["last_checkpoint"] is None


def test_validation_without_batches_is_an_error():
    objective = Scored()
    with pytest.raises(ValueError, match="no batches"):
        Evaluation.run(objective, objective.init(jax.random.key(0)), lambda p: iter([]), key=jax.random.key(0))
