"""Meshes: the same fit on one device, eight data-parallel devices and FSDP, with real sharding."""

import json
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from dew import Aux, Dataset, Field, InputSpec, Layout, MeshSpec, Objective, Trainer


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        dense = lambda features, names, name: nn.Dense(  # noqa: E731
            features, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), names), name=name
        )
        x = nn.gelu(dense(128, ("embed", "mlp"), "up")(x))
        x = dense(64, ("mlp", "embed"), "down")(x)
        return nn.Dense(1, name="head")(x)  # no logical names: the FSDP fallback decides


class Fit(Objective):
    model = MLP()
    inputs = InputSpec(Field("x", (64,)), Field("y", (1,)))
    ema_decay = 0.9

    def init(self, key, variables=None):
        return self.model.init(key, jnp.ones((1, 64)))

    def loss(self, variables, batch, step):
        error = self.model.apply(variables, batch["x"]) - batch["y"]
        return jnp.mean(error**2), Aux()


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 64)).astype(np.float32)
    y = np.sin(x[:, :1] + x[:, 1:2]).astype(np.float32)
    return Dataset.from_records({"x": x, "y": y}, batch=32)


def losses(mesh, steps=8, layout=Layout()):
    trainer = Trainer(Fit(), optax.adam(0.01), key=jax.random.key(0), mesh=mesh, layout=layout)
    state = trainer.fit(data(), steps=steps, log_every=steps)
    return [h["loss"] for h in trainer.history], state, trainer


ONE_DEVICE = """
import os, sys, json
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, {tests!r})
import jax
assert jax.device_count() == 1
from dew import MeshSpec
from test_mesh import losses
print(json.dumps(losses(MeshSpec())[0]))
"""


def test_one_device_eight_data_parallel_and_fsdp_give_the_same_losses():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    script = ONE_DEVICE.format(tests=str(Path(__file__).parent))
    single = json.loads(
        subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True,
                       timeout=300).stdout.strip().splitlines()[-1]
    )
    data_parallel, dp_state, dp_trainer = losses(MeshSpec())
    fsdp, fsdp_state, fsdp_trainer = losses(MeshSpec(fsdp=4))
    assert dp_trainer.mesh.shape["data"] == 8
    assert dict(fsdp_trainer.mesh.shape)["data"] == 2 and fsdp_trainer.mesh.shape["fsdp"] == 4
    np.testing.assert_allclose(data_parallel, single, rtol=2e-5)
    np.testing.assert_allclose(fsdp, single, rtol=2e-5)
    assert single[-1] < single[0]  # it trains
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        jax.device_get(dp_state.params),
        jax.device_get(fsdp_state.params),
    )


def test_fsdp_shards_parameters_optimizer_state_and_ema():
    _, state, trainer = losses(MeshSpec(fsdp=4), steps=1)
    params = state.params
    assert params["up"]["kernel"].sharding.spec == P("fsdp", None)  # embed -> fsdp
    assert params["down"]["kernel"].sharding.spec == P(None, "fsdp")
    assert params["head"]["kernel"].sharding.spec == P()  # 64 elements, below min_shard
    assert params["up"]["bias"].sharding.spec == P()  # below min_shard: replicated
    # each device holds a quarter of the kernel
    shard = params["up"]["kernel"].addressable_shards[0].data
    assert shard.shape == (16, 128)
    adam = state.opt_state[0]
    assert adam.mu["up"]["kernel"].sharding.spec == P("fsdp", None)
    assert adam.nu["down"]["kernel"].sharding.spec == P(None, "fsdp")
    assert state.ema["up"]["kernel"].sharding.spec == P("fsdp", None)


def test_data_parallel_replicates_parameters_and_splits_the_batch():
    _, state, trainer = losses(MeshSpec(), steps=1)
    assert state.params["up"]["kernel"].sharding.is_fully_replicated
    placed = trainer.place({"x": np.zeros((32, 64), np.float32)})
    assert placed["x"].addressable_shards[0].data.shape == (4, 64)


def test_layout_rules_map_logical_names_and_respect_divisibility():
    mesh = MeshSpec(fsdp=2, tensor=2).build()
    layout = Layout(min_shard=1)
    assert layout.spec((64, 128), ("embed", "mlp"), mesh) == P("fsdp", "tensor")
    assert layout.spec((64, 3), ("embed", "mlp"), mesh) == P("fsdp", None)  # 3 does not divide
    assert layout.spec((8,), ("norm",), mesh) == P(None)
    assert layout.spec((64, 128), None, mesh) == P(None, "fsdp")  # unnamed: largest dim that divides
    assert layout.spec((63, 5), None, mesh) == P()
    assert Layout(min_shard=10_000).spec((64, 128), ("embed", "mlp"), mesh) == P()
    custom = Layout(rules=(("embed", None), ("mlp", ("fsdp", "tensor"))), min_shard=1)
    assert custom.spec((64, 128), ("embed", "mlp"), mesh) == P(None, ("fsdp", "tensor"))
    with pytest.raises(ValueError, match="mesh axis 'model'"):
        Layout(rules=(("embed", "model"),))


def test_mesh_shape_fills_data_parallelism_and_refuses_bad_factors():
    assert MeshSpec(fsdp=2, tensor=2).shape(8)["data"] == 2
    assert MeshSpec(replicas=2, fsdp=4).shape(8) == {
        "replicas": 2, "stage": 1, "data": 1, "fsdp": 4, "expert": 1, "sequence": 1, "tensor": 1
    }
    with pytest.raises(ValueError, match="MeshSpec\\(fsdp=16.*needs a multiple of 16 devices, but 8"):
        MeshSpec(fsdp=16).build()
    with pytest.raises(ValueError, match="MeshSpec.tensor must be a positive integer; got 0"):
        MeshSpec(tensor=0)
    with pytest.raises(ValueError, match="MeshSpec.fsdp must be a positive integer; got 2.0"):
        MeshSpec(fsdp=2.0)
    assert MeshSpec(fsdp=np.int64(2)).fsdp == 2

