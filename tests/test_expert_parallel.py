"""Expert parallelism: Mixture(dispatch="exchange") over the expert mesh axis, and MeshSpec(expert=k) in training."""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Aux, Dataset, Field, InputSpec, MeshSpec, Objective, Trainer
from dew.nn import expert_parallel
from dew.nn.backbones import CausalTransformer
from dew.nn.moe import Mixture, router_metrics
from dew.objectives.lm import LMObjective
from dew.training import Layout
from dew.training import mesh as mesh_lib

WIDTH, ROWS = 16, 32  # 32 rows: 4 per device on 8 devices

# One layer per routing family; each must compute the same under both dispatches (with the blocked
# grouped product, what "auto" takes on the CPU for these few rows, ragged_dot or the padded product).
SETTINGS = {
    "top2-renormalized": dict(num_experts=8, top_k=2, normalize_top_k=True),
    "top3-qwen-shared-expert-ragged-dot": dict(num_experts=8, top_k=3, shared_expert_features=12,
                                               shared_expert_gate=True, grouped="ragged_dot"),
    "gpt-oss-biases-padded": dict(num_experts=8, top_k=2, router_bias=True, expert_bias=True, normalize_top_k=True,
                                  activation="clamped_swiglu", gate_up="interleaved", grouped="padded"),
    "deepseek-grouped": dict(num_experts=8, top_k=2, score="sigmoid", score_bias=True, groups=4, group_top_k=2,
                             normalize_top_k=True, routed_scale=2.5, shared_expert_features=12),
}


def _rows(seed=0):
    return jax.random.normal(jax.random.key(seed), (ROWS, WIDTH))


def _params(layer, rows, seed=1):
    """Initialized params moved off their init (zero biases become nonzero), so every term shows."""
    params = nn.unbox(layer.init(jax.random.key(seed), rows))["params"]
    noise = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda x: x + 0.2 * noise.standard_normal(x.shape).astype(np.float32), params)


def _loss_and_grads(layer, params, rows, split):
    """The layer's output, routing record and the gradients of ``sum(out^2)`` (params, rows), jitted
    under `split` (None: one device, no split)."""

    # collections besides the params (DeepSeek's 'balance' score_bias), as initialized
    held = {name: value for name, value in nn.unbox(layer.init(jax.random.key(1), rows)).items()
            if name not in ("params", "router")}

    def loss(params, rows):
        out, recorded = layer.apply({**held, "params": params}, rows, mutable=["router"])
        return jnp.sum(out**2), (out, recorded["router"])

    def run(params, rows):
        with expert_parallel.exchanging(split):
            return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, rows)

    (_, (out, recorded)), grads = jax.jit(run)(params, rows)
    return out, recorded, grads


def _split(expert):
    return mesh_lib.expert_split(MeshSpec(expert=expert).build())  # data takes the other 8 / expert devices


def _assert_close_trees(got, want, rtol):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.abs(w).max())


@functools.cache
def _global_reference(name):
    """The params of a `SETTINGS` layer, and its output, routing record and gradients on one device."""
    layer = Mixture(expert_features=10, **SETTINGS[name])
    params = _params(layer, _rows())
    return params, *_loss_and_grads(layer, params, _rows(), None)


@pytest.mark.parametrize("expert", [2, 4])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_exchange_computes_the_global_dispatchs_outputs_and_gradients(name, expert):
    exchange_layer = Mixture(expert_features=10, dispatch="exchange", **SETTINGS[name])
    rows = _rows()
    params, want_out, want_recorded, want_grads = _global_reference(name)
    out, recorded, grads = _loss_and_grads(exchange_layer, params, rows, _split(expert))
    # float32 sums in another order: outputs and gradients agree to 1e-5 of each leaf's largest entry
    _assert_close_trees(out, want_out, 1e-5)
    _assert_close_trees(grads, want_grads, 1e-5)
    metrics, want_metrics = router_metrics(recorded), router_metrics(want_recorded)
    assert float(metrics.pop("dropped")) == 0  # the default capacity drops nothing
    assert sorted(metrics) == sorted(want_metrics)
    if expert == 2:  # outside a split, the exchange is the global dispatch
        unsplit_out, _, _ = _loss_and_grads(exchange_layer, params, rows, None)
        np.testing.assert_array_equal(np.asarray(unsplit_out), np.asarray(want_out))


def test_a_wrong_reverse_permutation_is_caught(monkeypatch):
    params, want, _, _ = _global_reference("top2-renormalized")
    # results left in expert order instead of put back in the order the rows arrived
    monkeypatch.setattr(expert_parallel, "_unsort", lambda sorted_rows, order: sorted_rows)
    layer = Mixture(expert_features=10, dispatch="exchange", **SETTINGS["top2-renormalized"])
    got, _, _ = _loss_and_grads(layer, params, _rows(), _split(2))
    assert np.abs(np.asarray(got) - np.asarray(want)).max() > 1e-2


def _expert_outputs(params, rows, experts):
    """Each (row, choice)'s expert output ``[N, k, width]`` in NumPy."""
    p = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params["experts"])
    rows, experts = np.asarray(rows, np.float64), np.asarray(experts)
    gate = np.einsum("nd,nkdf->nkf", rows, p["gate_proj"][experts])
    up = np.einsum("nd,nkdf->nkf", rows, p["up_proj"][experts])
    return np.einsum("nkf,nkfd->nkd", gate / (1 + np.exp(-gate)) * up, p["down_proj"][experts])


def test_a_small_capacity_drops_the_assignments_past_it_and_counts_them():
    layer = Mixture(num_experts=8, top_k=2, expert_features=10, dispatch="exchange", capacity_factor=0.5)
    rows = _rows()
    params = _params(layer, rows)
    out, recorded, _ = _loss_and_grads(layer, params, rows, _split(4))  # 8 devices: data=2 x expert=4
    logits = np.asarray(rows, np.float64) @ np.asarray(params["gate"], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1)[:, :2]  # each row's two best experts, best first
    weights = np.take_along_axis(probs, experts, axis=-1)
    # rows split into 8 blocks of 4, block d on the device at expert index d % 4; each device's
    # assignments (row-major) fill ceil(0.5 * 4 * 2 / 4) = 1 slot per destination shard of 2 experts
    kept = np.zeros(experts.shape, bool)
    for block in range(8):
        taken = set()
        for row in range(block * 4, block * 4 + 4):
            for choice in range(2):
                shard = experts[row, choice] // 2
                kept[row, choice] = shard not in taken
                taken.add(shard)
    dropped = int((~kept).sum())
    assert dropped > 0
    assert float(router_metrics(recorded)["dropped"]) == dropped
    want = np.sum(np.where(kept[..., None], weights[..., None] * _expert_outputs(params, rows, experts), 0), axis=1)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)
    everything = np.sum(weights[..., None] * _expert_outputs(params, rows, experts), axis=1)
    assert np.abs(np.asarray(out) - everything).max() > 1e-2  # the dropped assignments are missing


def test_capacities_and_expert_counts_that_do_not_fit_are_refused():
    assert expert_parallel.capacity(rows=4, top_k=2, num_experts=8, shards=4, capacity_factor=None) == 8
    assert expert_parallel.capacity(rows=4, top_k=2, num_experts=8, shards=8, capacity_factor=None) == 4
    assert expert_parallel.capacity(rows=4, top_k=2, num_experts=8, shards=4, capacity_factor=1.25) == 3
    assert expert_parallel.capacity(rows=4, top_k=2, num_experts=8, shards=4, capacity_factor=100.0) == 8
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        Mixture(num_experts=8, top_k=2, expert_features=8, dispatch="exchange", capacity_factor=0.0)
    with pytest.raises(ValueError, match="capacity_factor=1.5 sizes the buffers of dispatch='exchange'"):
        Mixture(num_experts=8, top_k=2, expert_features=8, capacity_factor=1.5)
    layer = Mixture(num_experts=6, top_k=2, expert_features=8, dispatch="exchange")
    rows = _rows()
    params = _params(layer, rows)
    with pytest.raises(ValueError, match=r"6 experts does not split over MeshSpec\(expert=4\): 6 % 4 = 2"):
        _loss_and_grads(layer, params, rows, _split(4))


# --- training on an expert axis --------------------------------------------------------------------

TEXT = np.random.default_rng(0).integers(0, 64, size=(16, 17)).astype(np.int32)


def _trainer(mesh, dispatch="exchange"):
    """A Qwen3-MoE-shaped decoder: every layer a mixture of 8 experts, top-2 renormalized, q/k norms."""
    model = CausalTransformer(
        vocab_size=64, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_seq_len=32,
        mlp_features=48, qk_norm=True,
        mixture={"num_experts": 8, "top_k": 2, "expert_features": 16, "normalize_top_k": True, "dispatch": dispatch},
    )
    # eps 1e-4: Adam would scale a gradient at float32 summation noise (the meshes sum in other
    # orders) up to a whole step of 1e-2; 99% of the expert weights still move by 10x the tolerance
    return Trainer(LMObjective(model, seq_len=16, balance_coef=0.01), optax.adam(1e-2, eps=1e-4), key=jax.random.key(0),
                   mesh=mesh, layout=Layout(min_shard=1))


def _fit(trainer):
    state = trainer.fit(Dataset.from_records({"text": TEXT}, batch=8), steps=3, log_every=1)
    return [row["loss"] for row in trainer.history], nn.unbox(state.variables)["params"]


@pytest.fixture(scope="module")
def unsplit():
    return _fit(_trainer(MeshSpec(), dispatch="global"))


def _check_trains_like_unsplit(trainer, unsplit):
    losses, params = _fit(trainer)
    want_losses, want_params = unsplit
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    _assert_close_trees(params, want_params, 1e-4)  # float32 sums in another order, through three Adam steps
    return losses


def test_a_trainer_step_on_an_expert_axis_matches_one_device_and_shards_the_experts(unsplit):
    trainer = _trainer(MeshSpec(expert=2))  # data=4 x expert=2
    _check_trains_like_unsplit(trainer, unsplit)
    assert trainer.history[-1]["router/dropped"] == 0
    # each device holds half of every expert kernel, and so do the optimizer's moments
    _, shardings = trainer._plan()
    experts = shardings.variables["params"]["layers_0"]["mlp"]["experts"]
    moments = shardings.opt_state[0].mu["layers_0"]["mlp"]["experts"]
    for sharding in (experts["gate_proj"], experts["down_proj"], moments["up_proj"]):
        assert sharding.shard_shape((8, 32, 16))[0] == 4 and sharding.spec[0] == "expert"
    # the step trades rows: all-to-alls in the lowered program, two per layer each way
    lowered = trainer.lower({"text": TEXT[:8]}).as_text()
    assert len(re.findall(r"all_to_all", lowered)) >= 2 * 2 * 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh, dispatch",
    [(MeshSpec(expert=4), "exchange"), (MeshSpec(expert=2, fsdp=2), "exchange"), (MeshSpec(expert=4), "global"),
     (MeshSpec(expert=2, fsdp=2), "global")],
    ids=["expert4-exchange", "expert2-fsdp2-exchange", "expert4-global", "expert2-fsdp2-global"],
)
def test_other_expert_meshes_and_dispatches_train_like_one_device(mesh, dispatch, unsplit):
    _check_trains_like_unsplit(_trainer(mesh, dispatch), unsplit)


class Regression(Objective):
    """An objective whose model has no mixture layers."""

    model = nn.Dense(1)
    inputs = InputSpec(Field("x", (4,)))

    def init(self, key, variables=None):
        return self.model.init(key, jnp.ones((1, 4)))

    def loss(self, variables, batch, step):
        return jnp.mean(self.model.apply(variables, batch["x"]) ** 2), Aux()


def test_an_expert_axis_without_mixture_layers_is_refused():
    assert MeshSpec(expert=2).shape(8)["expert"] == 2
    t = Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0), mesh=MeshSpec(expert=2))
    with pytest.raises(ValueError, match=r"MeshSpec\(expert=2\).*Regression's model has no mixture layers.*expert=1"):
        t.fit(Dataset.from_records({"x": np.ones((8, 4), np.float32)}, batch=8), steps=1)
