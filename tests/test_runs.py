"""Run records: run.json round trips, and dew.pipeline rebuilds a run from the record alone."""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dew
from dew import Checkpoints, Dataset, Trainer
from dew.config import ModelConfig, ObjectiveConfig, OptimConfig, RunConfig, TrainerConfig
from dew.config.records import from_record, to_record
from dew.data import Loading, TokenWindows
from dew.nn.backbones import CausalTransformer, LayerKind
from dew.objectives.lm import LMObjective
from dew.sampling import Sampling

TINY_TOOLS = "tests/fixtures/tokenizers/tiny-tools"


def test_records_round_trip_modules_dtypes_tuples_and_nested_dataclasses():
    model = CausalTransformer(vocab_size=8, emb_features=32, num_layers=2, num_heads=2, dtype=jnp.bfloat16,
                              layer_types=("sliding_attention", "full_attention"),
                              kinds={"sliding_attention": LayerKind(window=3)}, rope_scaling={"rope_type": "linear", "factor": 2.0})
    record = json.loads(json.dumps(to_record(model)))
    rebuilt = from_record(record)
    assert rebuilt == model and rebuilt.dtype == jnp.bfloat16
    windows = TokenWindows(path="data", seq_len=16, loading=Loading(workers=0, threads=2))
    assert from_record(json.loads(json.dumps(to_record(windows)))) == windows
    with pytest.raises(TypeError, match="Cannot record a object"):
        to_record(object())


def test_optim_config_builds_the_named_optimizer_and_refuses_unknown_ones():
    params = {"w": jnp.ones(3)}
    optimizer = OptimConfig(optimizer="sgd", learning_rate=0.5).build()
    updates, _ = optimizer.update({"w": jnp.ones(3)}, optimizer.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.5)
    warm = OptimConfig(optimizer="adam", learning_rate=1.0, warmup_steps=10).schedule()
    assert float(warm(5)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="one of \\('adam', 'adamw', 'sgd', 'lion'\\)"):
        OptimConfig(optimizer="adagrad")


def pattern_run(directory, tokenizer=None):
    model = CausalTransformer(vocab_size=8, emb_features=32, num_layers=1, num_heads=2, mlp_features=64,
                              max_seq_len=32)
    row = np.resize(np.array([1, 2, 3, 4], np.int32), 17)
    batch = {"text": np.tile(row, (8, 1))}
    import grain.python as grain

    stream = grain.MapDataset.source([batch]).repeat().to_iter_dataset()
    data = Dataset(train=lambda p: iter(stream), records=8, batch=8)
    objective = LMObjective(model, seq_len=16, ema_decay=0.5)
    optim = OptimConfig(optimizer="adam", learning_rate=0.01)
    checkpoints = Checkpoints(directory)
    state = Trainer(objective, optim.build(), key=jax.random.key(0), checkpoints=checkpoints).fit(
        data, steps=30, log_every=30, checkpoint_every=30)
    checkpoints.wait()
    config = RunConfig(
        model=ModelConfig.from_model(model),
        data=TokenWindows(seq_len=16),
        optim=optim,
        trainer=TrainerConfig(checkpoint_dir=str(directory), steps=30, batch_size=8),
        objective=ObjectiveConfig.from_objective(objective),
        sampling=Sampling(temperature=0.0),
    )
    config.save(directory, tokenizer=tokenizer)
    return objective, state, config


def test_dew_pipeline_rebuilds_a_saved_run_from_its_record(tmp_path):
    run = tmp_path / "run"
    objective, state, config = pattern_run(run)
    assert sorted(p.name for p in run.iterdir()) == ["30", "run.json"]
    loaded = RunConfig.load(run)
    assert loaded.model == config.model and loaded.optim == config.optim and loaded.data == config.data
    assert loaded.objective.settings["seq_len"] == 16 and loaded.sampling == Sampling(temperature=0.0)

    task = dew.pipeline(run)
    from_state = objective.pipeline(state)
    a = task([[1, 2]], 6, key=jax.random.key(1))
    b = from_state([[1, 2]], 6, key=jax.random.key(1))
    assert a.host().tokens.tolist() == np.asarray(b.tokens).tolist() == [[3, 4, 1, 2, 3, 4]]
    # the EMA weights by default, the live ones on request
    live = dew.pipeline(run, ema=False)
    jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(live.variables["params"]),
                           jax.device_get(state.params))
    jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(task.variables["params"]),
                           jax.device_get(state.ema))


def test_a_run_keeps_its_tokenizer_files(tmp_path):
    run = tmp_path / "run"
    pattern_run(run, tokenizer=TINY_TOOLS)
    assert json.loads((run / "run.json").read_text())["tokenizer"] == "tokenizer"
    assert (run / "tokenizer" / "tokenizer.json").exists()
    task = dew.pipeline(run)
    assert task.tokenizer is not None and task.tokenizer.decode(task.tokenizer.encode("hello")) == "hello"


def test_pipeline_refuses_what_is_not_a_local_run_or_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="could not be read from the cache"):
        dew.pipeline("Qwen/Qwen3-0.6B")  # offline, and not in the (empty) test cache
    (tmp_path / "run.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a Dew run record"):
        RunConfig.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="holds no run.json"):
        RunConfig.load(tmp_path / "missing")


def test_the_registry_resolves_aliases_and_import_paths():
    from dew import registry
    from dew.nn.backbones import SimpleDiT

    assert registry.resolve_model("simple_dit") is SimpleDiT
    assert registry.resolve_model("dew.nn.backbones.causal_transformer.CausalTransformer") is CausalTransformer
    for alias in registry.models:
        assert registry.resolve_model(alias) is not None
    with pytest.raises(ValueError, match="Unknown model 'gpt5'"):
        registry.resolve_model("gpt5")
