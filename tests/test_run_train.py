"""RunConfig.train: a run directory with run.json written first, tracked, ending on a checkpoint that
dew.pipeline reloads; TrainerConfig.xla_flags reaching XLA before the backend starts."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import dew
from dew import Dataset
from dew.config import ModelConfig, ObjectiveConfig, OptimConfig, RunConfig, TrainerConfig
from dew.nn.backbones import CausalTransformer
from dew.objectives.lm import LMObjective
from dew.tracking import Tracker

ROW = np.resize(np.array([1, 2, 3, 4], np.int32), 9)
BATCH = {"text": np.tile(ROW, (8, 1))}


def tiny_objective(width=32):
    model = CausalTransformer(vocab_size=8, emb_features=width, num_layers=1, num_heads=2, mlp_features=64,
                              max_seq_len=16)
    return LMObjective(model, seq_len=8)


def config_for(objective, directory, **trainer):
    settings = dict(name="run", checkpoint_dir=str(directory), steps=6, batch_size=8, log_every=3)
    settings.update(trainer)
    return RunConfig(model=ModelConfig.from_model(objective.model),
                     optim=OptimConfig(optimizer="adam", learning_rate=0.01),
                     trainer=TrainerConfig(**settings))


class _SeesRunFile(Tracker):
    """Notes, at the first report of the run, whether run.json was already on disk."""

    def __init__(self, run_file):
        self.run_file, self.first = run_file, None

    def log(self, data, step=None):
        if self.first is None:
            self.first = self.run_file.is_file()


def test_train_writes_run_json_first_and_the_run_reloads_with_dew_pipeline(tmp_path, monkeypatch):
    objective = tiny_objective()
    data = Dataset.from_records(BATCH, batch=8)
    # a flag the environment already carries (the backend has started; XLA has read it or never will)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false")
    config = config_for(objective, tmp_path, xla_flags=("--xla_cpu_enable_fast_math=false",))
    seen = _SeesRunFile(tmp_path / "run" / "run.json")
    state = config.train(objective, data, tracker=seen)
    assert seen.first is True
    assert int(state.step) == 6

    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["trainer"]["name"] == "run" and record["objective"]["target"].endswith("LMObjective")
    assert RunConfig.load(tmp_path / "run") == config.describing(objective, "run")  # xla_flags and all
    task = dew.pipeline(tmp_path / "run", ema=False)
    np.testing.assert_array_equal(task([[1, 2]], 5, seed=0).host().tokens,
                                  np.asarray(objective.pipeline(state, ema=False)([[1, 2]], 5, seed=0).tokens))


def test_train_tracks_locally_by_default_checkpoints_the_last_step_and_resumes(tmp_path):
    objective = tiny_objective()
    data = Dataset.from_records(BATCH, batch=8)
    config = config_for(objective, tmp_path, checkpoint_every=None, name=None)
    state = config.train(objective, data, name="a")
    run = tmp_path / "a"
    assert sorted(p.name for p in run.iterdir()) == ["6", "run.json", "tracking"]
    losses = [json.loads(line) for line in (run / "tracking" / "scalars.jsonl").read_text().splitlines()]
    assert [row["step"] for row in losses] == [3, 6] and all("train/loss" in row for row in losses)
    # a finished run trained again restores its last step and trains nothing more
    again = config.train(objective, data, name="a")
    for a, b in zip(jax.tree_util.tree_leaves(state.variables), jax.tree_util.tree_leaves(again.variables)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a longer target continues from it
    longer = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, steps=8))
    assert int(longer.train(objective, data, name="a").step) == 8


def test_train_refuses_a_config_that_does_not_describe_what_it_trains(tmp_path):
    objective = tiny_objective()
    data = Dataset.from_records(BATCH, batch=8)
    config = config_for(objective, tmp_path)
    with pytest.raises(ValueError, match="records the model .* but the objective trains"):
        config.train(tiny_objective(width=64), data)
    with pytest.raises(ValueError, match="batches of 4 rows but trainer.batch_size is 8"):
        config.train(objective, Dataset.from_records(BATCH, batch=4))
    other = dataclasses.replace(config, objective=ObjectiveConfig(target="dew.objectives.lm.LMObjective",
                                                                  settings={"seq_len": 4}))
    with pytest.raises(ValueError, match="records the objective"):
        other.train(objective, data)
    with pytest.raises(ValueError, match="relative directory name"):
        config.train(objective, data, name="../elsewhere")
    with pytest.raises(ValueError, match="got no data"):
        config.train(objective)
    assert not (tmp_path / "run").exists()  # nothing written for a run that could not start


def test_xla_flags_reach_xla_before_the_backend_starts(tmp_path):
    program = textwrap.dedent("""
        import jax
        from dew.config import TrainerConfig
        TrainerConfig(xla_flags=("--xla_force_host_platform_device_count=3",)).apply_xla_flags()
        print(jax.device_count())
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "3"


def test_xla_flags_after_the_backend_started_raise_unless_already_applied(monkeypatch):
    jax.devices()  # this process has started its backend
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    TrainerConfig(xla_flags=("--xla_cpu_enable_fast_math=false",)).apply_xla_flags()  # already there: fine
    with pytest.raises(RuntimeError, match="before JAX starts its backend.*apply_xla_flags"):
        TrainerConfig(xla_flags=("--xla_gpu_deterministic_ops=true",)).apply_xla_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false"
