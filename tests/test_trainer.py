"""The Trainer's contracts: updates, EMA, accumulation, collections, precision and its errors."""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Aux, Checkpoints, Dataset, Field, InputSpec, Objective, Trainer


class Linear(Objective):
    """Least squares on a dense layer; settings as class attributes."""

    model = nn.Dense(1)
    inputs = InputSpec(Field("x", (3,)), Field("y", (1,)))

    def __init__(self, ema_decay=None):
        self.ema_decay = ema_decay

    def init(self, key, variables=None):
        return self.model.init(key, jnp.ones((1, 3)))

    def loss(self, variables, batch, step):
        error = self.model.apply(variables, batch["x"]) - batch["y"]
        return jnp.mean(error**2), Aux(metrics={"abs": jnp.mean(jnp.abs(error))})


def linear_data(batch=8, records=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(records, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.3).astype(np.float32)
    return Dataset.from_records({"x": x, "y": y}, batch=batch, seed=seed)


def fixed_batches(batch):
    return Dataset(train=lambda partition: itertools.repeat(batch), records=len(batch["x"]), batch=len(batch["x"]))


def test_regression_from_the_readme_learns_the_line():
    class Regression(Objective):
        model = nn.Dense(1)
        inputs = InputSpec(Field("x", (1,)))

        def init(self, key, variables=None):
            return self.model.init(key, jnp.ones((1, 1)))

        def loss(self, variables, batch, step):
            prediction = self.model.apply(variables, batch["x"])
            loss = jnp.mean((prediction - batch["y"]) ** 2)
            return loss, Aux(metrics={"mse": loss})

    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(32, 1)
    data = Dataset.from_records({"x": x, "y": 2 * x + 1}, batch=32)
    objective = Regression()
    state = Trainer(objective, optax.sgd(0.1), key=jax.random.key(0)).fit(data, steps=100, log_every=25)
    predictions = objective.model.apply(state.variables, jnp.array([[0.0], [1.0]]))
    np.testing.assert_allclose(np.asarray(predictions)[:, 0], [1.0, 3.0], atol=0.01)
    assert int(state.step) == 100 and int(state.updates) == 100


def test_one_step_applies_the_optimizer_update_to_the_initial_parameters():
    objective = Linear()
    trainer = Trainer(objective, optax.sgd(0.5), key=jax.random.key(1))
    initial = jax.device_get(trainer.init_state().params)
    batch = next(linear_data().train(__import__("dew").data.Partition()))
    state = trainer.fit(fixed_batches(batch), steps=1, log_every=1)

    def loss(params):
        return objective.loss({"params": params}, batch, None)[0]

    grads = jax.grad(loss)(initial)
    expected = jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, initial, grads)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), jax.device_get(state.params), expected
    )
    assert trainer.history[0]["step"] == 1 and "abs" in trainer.history[0]


def test_ema_with_decay_one_half_is_the_mean_of_old_and_new_parameters():
    trainer = Trainer(Linear(ema_decay=0.5), optax.sgd(0.5), key=jax.random.key(2))
    old = jax.device_get(trainer.init_state().params)
    state = trainer.fit(linear_data(), steps=1, log_every=1)
    new = jax.device_get(state.params)
    expected = jax.tree_util.tree_map(lambda a, b: (a + b) / 2, old, new)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), jax.device_get(state.ema), expected
    )
    assert not np.allclose(new["kernel"], old["kernel"])
    assert state.averaged["params"] is state.ema


def test_ema_with_decay_one_stays_frozen_and_none_keeps_no_copy():
    trainer = Trainer(Linear(ema_decay=1.0), optax.sgd(0.5), key=jax.random.key(3))
    old = jax.device_get(trainer.init_state().params)
    state = trainer.fit(linear_data(), steps=3, log_every=3)
    jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(state.ema), old)

    plain = Trainer(Linear(ema_decay=None), optax.sgd(0.5), key=jax.random.key(3)).fit(
        linear_data(), steps=1, log_every=1
    )
    assert plain.ema is None
    with pytest.raises(ValueError, match="no EMA copy"):
        plain.averaged


class Noisy(Linear):
    """A loss that uses the step key, so microbatch keys matter only through this term."""

    def loss(self, variables, batch, step):
        error = self.model.apply(variables, batch["x"]) - batch["y"]
        return jnp.mean(error**2), Aux(metrics={"rows": jnp.asarray(error.shape[0], jnp.float32)})


@pytest.mark.parametrize("parts", [2, 4])
def test_gradient_accumulation_equals_one_large_batch(parts):
    batch = next(linear_data(batch=16).train(__import__("dew").data.Partition()))
    big = Trainer(Noisy(), optax.adam(0.05), key=jax.random.key(4))
    accumulated = Trainer(Noisy(), optax.adam(0.05), key=jax.random.key(4), accumulation=parts)
    a = big.fit(fixed_batches(batch), steps=3, log_every=3)
    b = accumulated.fit(fixed_batches(batch), steps=3, log_every=3)
    jax.tree_util.tree_map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-6),
        jax.device_get(a.params),
        jax.device_get(b.params),
    )
    assert [h["loss"] for h in big.history] == pytest.approx([h["loss"] for h in accumulated.history], rel=1e-5)
    # each microbatch saw 16 / parts rows
    assert accumulated.history[0]["rows"] == 16 / parts


def test_accumulation_that_does_not_divide_the_batch_fails_before_training():
    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), accumulation=3)
    with pytest.raises(ValueError, match="8 rows.*3 microbatches.*multiple of 3"):
        trainer.fit(linear_data(batch=8), steps=1)


class BatchNormRegression(Objective):
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
            return nn.Dense(1)(x)

    model = Net()
    inputs = InputSpec(Field("x", (3,)), Field("y", (1,)))

    def init(self, key, variables=None):
        return self.model.init(key, jnp.ones((2, 3)), train=False)

    def loss(self, variables, batch, step):
        prediction, changed = self.model.apply(variables, batch["x"], train=True, mutable=["batch_stats"])
        return jnp.mean((prediction - batch["y"]) ** 2), Aux(variables=changed)


def test_batch_norm_statistics_update_through_aux_variables():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(32, 3)) * 3 + 5).astype(np.float32)
    batch = {"x": x, "y": np.zeros((32, 1), np.float32)}
    trainer = Trainer(BatchNormRegression(), optax.sgd(0.01), key=jax.random.key(0))
    state = trainer.fit(fixed_batches(batch), steps=1, log_every=1)
    mean = np.asarray(state.variables["batch_stats"]["BatchNorm_0"]["mean"])
    # momentum 0.5 from a zero start: half the batch mean after one step
    np.testing.assert_allclose(mean, 0.5 * x.mean(axis=0), rtol=1e-5)
    state = trainer.fit(fixed_batches(batch), steps=2, log_every=1)
    np.testing.assert_allclose(
        np.asarray(state.variables["batch_stats"]["BatchNorm_0"]["mean"]), 0.75 * x.mean(axis=0), rtol=1e-5
    )


def test_mixed_precision_keeps_float32_master_weights_and_optimizer_state():
    class Half(Linear):
        model = nn.Dense(1, dtype=jnp.bfloat16)

        def loss(self, variables, batch, step):
            prediction = self.model.apply(variables, batch["x"])
            assert prediction.dtype == jnp.bfloat16  # computes in its own dtype
            error = prediction.astype(jnp.float32) - batch["y"]
            return jnp.mean(error**2), Aux()

    state = Trainer(Half(ema_decay=0.9), optax.adam(0.01), key=jax.random.key(0)).fit(
        linear_data(), steps=2, log_every=2
    )
    leaves = jax.tree_util.tree_leaves((state.params, state.ema))
    leaves += [x for x in jax.tree_util.tree_leaves(state.opt_state) if x.ndim > 0]
    assert leaves and all(leaf.dtype == jnp.float32 for leaf in leaves)


def test_the_step_and_init_compile_once_across_fits(caplog):
    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0))
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        trainer.fit(linear_data(), steps=5, log_every=2)
        trainer.fit(linear_data(), steps=9, log_every=2)
    compiled = [r.getMessage().split(" with ")[0] for r in caplog.records if "Compiling jit(" in r.getMessage()]
    assert compiled.count("Compiling jit(_train_step)") == 1
    assert compiled.count("Compiling jit(init)") == 1


class Heavy(Linear):
    """Linear with ~50 ms of matrix products in its loss, so a step outlasts the host's work."""

    def loss(self, variables, batch, step):
        loss, aux = super().loss(variables, batch, step)
        start = jnp.full((384, 384), 1e-3) + variables["params"]["bias"][0]
        heavy = jax.lax.fori_loop(0, 40, lambda i, m: jnp.tanh(m @ m), start)
        return loss + 0.0 * heavy.sum(), aux


def test_on_a_cpu_each_step_is_dispatched_once_the_last_one_is_done():
    """XLA:CPU spends about twice the CPU time on a step dispatched before its inputs are ready,
    so the loop waits for the state first (the next batch is read and placed meanwhile)."""
    trainer = Trainer(Heavy(), optax.sgd(0.1), key=jax.random.key(0))
    step_fn = trainer.compiled_step()
    ready = []

    def recording(state, batch):
        ready.append(all(leaf.is_ready() for leaf in jax.tree_util.tree_leaves(state.variables)))
        return step_fn(state, batch)

    trainer._step_fn = recording
    trainer.fit(linear_data(), steps=4, log_every=4)
    assert ready == [True] * 4


def test_a_batch_that_does_not_match_the_input_spec_names_the_field_and_shapes():
    batch = {"x": np.zeros((8, 4), np.float32), "y": np.zeros((8, 1), np.float32)}
    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"'x' has shape \(8, 4\).*\('batch', 3\)"):
        trainer.fit(fixed_batches(batch), steps=1)
    with pytest.raises(ValueError, match="no field 'y'"):
        trainer.fit(fixed_batches({"x": np.zeros((8, 3), np.float32)}), steps=1)


def test_an_init_without_params_is_refused():
    class NoParams(Linear):
        def init(self, key, variables=None):
            return {"weights": jnp.zeros(3)}

    with pytest.raises(ValueError, match="'params' collection.*got \\['weights'\\]"):
        Trainer(NoParams(), optax.sgd(0.1), key=jax.random.key(0)).fit(linear_data(), steps=1)


def test_mesh_factors_that_do_not_divide_the_devices_are_refused():
    from dew import MeshSpec

    with pytest.raises(ValueError, match="needs a multiple of 3 devices, but 8"):
        Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), mesh=MeshSpec(fsdp=3))


class Exploding(Linear):
    def loss(self, variables, batch, step):
        loss, aux = super().loss(variables, batch, step)
        return jnp.where(step.step >= 4, jnp.nan, loss), aux


def test_a_non_finite_loss_stops_the_run_naming_the_step_and_last_checkpoint(tmp_path):
    checkpoints = Checkpoints(tmp_path / "ckpt", keep=None)
    trainer = Trainer(Exploding(), optax.sgd(0.1), key=jax.random.key(0), checkpoints=checkpoints)
    with pytest.raises(FloatingPointError, match=r"non-finite at step 5.*last checkpoint is step 4"):
        trainer.fit(linear_data(), steps=10, log_every=100, checkpoint_every=2)
    checkpoints.wait()
    assert checkpoints.steps() == [2, 4]  # the bad state (step 5, 6) was never saved


def test_a_non_finite_loss_at_a_checkpoint_step_is_not_saved(tmp_path):
    checkpoints = Checkpoints(tmp_path / "ckpt", keep=None)
    trainer = Trainer(Exploding(), optax.sgd(0.1), key=jax.random.key(0), checkpoints=checkpoints)
    with pytest.raises(FloatingPointError, match="step 5"):
        trainer.fit(linear_data(), steps=10, log_every=100, checkpoint_every=5)
    checkpoints.wait()
    assert checkpoints.steps() == []


def test_bad_arguments_fail_with_what_was_expected():
    with pytest.raises(TypeError, match="Optax GradientTransformation"):
        Trainer(Linear(), "adam", key=jax.random.key(0))
    with pytest.raises(ValueError, match="accumulation must be a positive int"):
        Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), accumulation=0)
    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0))
    with pytest.raises(ValueError, match="steps must be an int >= 0"):
        trainer.fit(linear_data(), steps=-1)
    with pytest.raises(ValueError, match="checkpoint_every needs somewhere to write"):
        trainer.fit(linear_data(), steps=2, checkpoint_every=1)
    with pytest.raises(ValueError, match="eval_every needs validation data"):
        trainer.fit(linear_data(), steps=2, eval_every=1)


def test_a_batch_smaller_than_the_data_axis_is_replicated_with_a_warning():
    small = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0))
    with pytest.warns(UserWarning, match="4 rows, which do not split over the mesh's 8"):
        state = small.fit(linear_data(batch=4), steps=2, log_every=2)
    placed = small.place({"x": np.zeros((4, 3), np.float32)})
    assert placed["x"].sharding.is_fully_replicated
    assert int(state.step) == 2


def test_a_rollout_turns_each_batch_into_training_data_from_the_current_weights():
    seen = []

    def rollout(variables, batch, key):
        seen.append(np.asarray(variables["params"]["kernel"]).copy())
        return {"x": batch["x"], "y": batch["y"] + 1.0}  # e.g. rewards computed on the host

    trainer = Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), rollout=rollout)
    trainer.fit(linear_data(), steps=3, log_every=3)
    assert len(seen) == 3

    class Shifted(Linear):
        def loss(self, variables, batch, step):
            return super().loss(variables, {"x": batch["x"], "y": batch["y"] + 1.0}, step)

    for steps in (1, 2):  # the rollout before step s+1 saw the weights after step s
        plain = Trainer(Shifted(), optax.sgd(0.1), key=jax.random.key(0)).fit(linear_data(), steps=steps, log_every=9)
        np.testing.assert_allclose(seen[steps], np.asarray(plain.params["kernel"]), rtol=1e-6)
    assert not np.allclose(seen[0], seen[1])
    with pytest.raises(TypeError, match="rollout must be callable"):
        Trainer(Linear(), optax.sgd(0.1), key=jax.random.key(0), rollout="sample")
