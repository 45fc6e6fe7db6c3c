"""dew.nn.moe.Mixture and mixture layers in CausalTransformer: routing, dispatch, statistics, plans."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.inference.decode_layout import decode_layout
from dew.nn import moe
from dew.nn.backbones.causal_transformer import CausalTransformer
from dew.nn.moe import (
    ExpertWeights,
    Mixture,
    block_counts,
    block_rows,
    blocked_experts,
    capacities,
    clamped_swiglu,
    padded_experts,
    padded_layout,
    router_metrics,
    swiglu,
)
from dew.objectives.lm import LMObjective
from dew.sampling import Sampling, generate

WIDTH = 16


def _rows(n=24, seed=0):
    return jax.random.normal(jax.random.key(seed), (n, WIDTH))


def _params(layer, rows, seed=1):
    """Initialized params moved off their init, so a wrong slice or a skipped product shows."""
    params = nn.unbox(layer.init(jax.random.key(seed), rows))["params"]
    noise = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda x: x + 0.2 * noise.standard_normal(x.shape).astype(np.float32), params)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _loop_reference(params, rows, top_k, normalize, scale, shared_gate):
    """The layer row by row in NumPy: each row's top-k experts by softmax score, one at a time."""
    rows = np.asarray(rows, np.float64)
    p = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)
    logits = rows @ p["gate"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(rows)
    for t, row in enumerate(rows):
        chosen = np.argsort(-probs[t])[:top_k]
        weights = probs[t, chosen] / (probs[t, chosen].sum() if normalize else 1.0)
        for e, w in zip(chosen, weights):
            experts = p["experts"]
            hidden = _silu(row @ experts["gate_proj"][e]) * (row @ experts["up_proj"][e])
            out[t] += scale * w * (hidden @ experts["down_proj"][e])
    if "shared_expert" in p:
        s = p["shared_expert"]
        shared = (_silu(rows @ s["gate_proj"]["kernel"]) * (rows @ s["up_proj"]["kernel"])) @ s["down_proj"]["kernel"]
        if shared_gate:
            shared = shared / (1.0 + np.exp(-(rows @ p["shared_expert_gate"]["kernel"])))
        out += shared
    return out


@pytest.mark.parametrize(
    "settings",
    [dict(normalize_top_k=True, grouped="ragged_dot"), dict(normalize_top_k=True, grouped="blocks"),
     dict(normalize_top_k=True, grouped="padded"),
     dict(normalize_top_k=False, routed_scale=2.5), dict(shared_expert_features=12, shared_expert_gate=True),
     dict(shared_expert_features=12)],
    ids=["renormalized-ragged-dot", "renormalized-blocks", "renormalized-padded", "scaled", "gated-shared-expert",
         "shared-expert"],
)
def test_global_dispatch_computes_each_rows_top_k_experts(settings):
    layer = Mixture(num_experts=6, top_k=2, expert_features=10, **settings)
    rows = _rows()
    params = _params(layer, rows)
    got = np.asarray(layer.apply({"params": params}, rows))
    want = _loop_reference(params, rows, 2, layer.normalize_top_k, layer.routed_scale, layer.shared_expert_gate)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # negative controls: the reference tells another top-k or the other normalization apart
    assert np.abs(got - _loop_reference(params, rows, 3, layer.normalize_top_k, layer.routed_scale,
                                         layer.shared_expert_gate)).max() > 1e-2
    assert np.abs(got - _loop_reference(params, rows, 2, not layer.normalize_top_k, layer.routed_scale,
                                         layer.shared_expert_gate)).max() > 1e-2


def _grouped_sigmoid_reference(params, bias, rows, top_k, groups, group_top_k, scale, bias_weights=False):
    """DeepSeek-V3's router and experts row by row in NumPy: sigmoid scores, the bias added for the
    choice only, the best groups by their two best biased scores, the chosen scores renormalized.
    ``bias_weights`` (a negative control) weights the experts by the biased scores instead."""
    rows = np.asarray(rows, np.float64)
    p = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)
    scores = 1.0 / (1.0 + np.exp(-(rows @ p["gate"])))
    choice = scores + np.asarray(bias, np.float64)
    per_group = choice.shape[1] // groups
    out = np.zeros_like(rows)
    for t, row in enumerate(rows):
        rating = np.sort(choice[t].reshape(groups, per_group), axis=1)[:, -2:].sum(1)
        allowed = np.zeros(groups, bool)
        allowed[np.argsort(-rating)[:group_top_k]] = True
        masked = np.where(np.repeat(allowed, per_group), choice[t], -np.inf)
        chosen = np.argsort(-masked)[:top_k]
        weights = (choice if bias_weights else scores)[t, chosen]
        weights = weights / weights.sum()
        for e, w in zip(chosen, weights):
            experts = p["experts"]
            hidden = _silu(row @ experts["gate_proj"][e]) * (row @ experts["up_proj"][e])
            out[t] += scale * w * (hidden @ experts["down_proj"][e])
    return out


def test_the_grouped_sigmoid_router_chooses_by_biased_scores_and_weights_by_plain_ones():
    layer = Mixture(num_experts=8, top_k=3, expert_features=10, score="sigmoid", score_bias=True, groups=4,
                    group_top_k=2, normalize_top_k=True, routed_scale=2.5)
    rows = _rows(40)
    params = _params(layer, rows)
    bias = jnp.asarray(np.random.default_rng(3).normal(0, 0.3, 8), jnp.float32)
    got = np.asarray(layer.apply({"params": params, "balance": {"score_bias": bias}}, rows))
    want = _grouped_sigmoid_reference(params, bias, rows, 3, 4, 2, 2.5)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # negative controls: the bias as a weight, every group allowed, or no bias each route otherwise
    assert np.abs(got - _grouped_sigmoid_reference(params, bias, rows, 3, 4, 2, 2.5, bias_weights=True)).max() > 1e-2
    assert np.abs(got - _grouped_sigmoid_reference(params, bias, rows, 3, 4, 4, 2.5)).max() > 1e-2
    assert np.abs(got - _grouped_sigmoid_reference(params, np.zeros(8), rows, 3, 4, 2, 2.5)).max() > 1e-2


def test_no_gradient_reaches_the_balancing_bias():
    layer = Mixture(num_experts=8, top_k=2, expert_features=8, score="sigmoid", score_bias=True, groups=2,
                    group_top_k=1)
    rows = _rows(16)
    variables = nn.unbox(layer.init(jax.random.key(1), rows))
    assert "score_bias" not in variables["params"]  # a collection of its own: no optimizer or decay sees it
    variables["balance"]["score_bias"] = jnp.linspace(-0.5, 0.5, 8)
    grads = jax.grad(lambda v: jnp.sum(layer.apply(v, rows) ** 2))(variables)
    assert float(jnp.abs(grads["balance"]["score_bias"]).max()) == 0.0
    assert float(jnp.abs(grads["params"]["gate"]).max()) > 0.0
    with pytest.raises(ValueError, match="no 'balance' collection with its score_bias"):
        layer.apply({"params": variables["params"]}, rows)


@pytest.mark.parametrize("grouped", ["ragged_dot", "blocks", "padded"])
def test_gradients_through_the_grouped_products_match_a_dense_formulation(grouped):
    """Every expert applied to every row, weighted by a mask of the chosen ones: the same layer
    computed without sorting or grouped products, so its gradients check the dispatch's."""
    layer = Mixture(num_experts=4, top_k=2, expert_features=8, normalize_top_k=True, grouped=grouped)
    rows = _rows(10)
    params = _params(layer, rows)

    def dense(params, rows):
        probs = jax.nn.softmax(rows @ params["gate"], axis=-1)
        top, chosen = jax.lax.top_k(probs, 2)
        weights = jnp.sum(jax.nn.one_hot(chosen, 4) * (top / top.sum(-1, keepdims=True))[..., None], axis=1)
        e = params["experts"]
        gate, up = (jnp.einsum("nd,edf->enf", rows, e[name]) for name in ("gate_proj", "up_proj"))
        hidden = nn.silu(gate) * up
        return jnp.einsum("enf,efd,ne->nd", hidden, e["down_proj"], weights)

    target = jax.random.normal(jax.random.key(5), (10, WIDTH))
    ours = jax.jit(jax.grad(lambda p: jnp.sum((layer.apply({"params": p}, rows) - target) ** 2)))(params)
    theirs = jax.jit(jax.grad(lambda p: jnp.sum((dense(p, rows) - target) ** 2)))(params)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)
    assert float(jnp.abs(ours["gate"]).max()) > 0  # the router learns through the chosen weights


@pytest.mark.parametrize("rows, top_k", [(1, 2), (3, 1), (40, 3), (300, 2)])
def test_blocked_padded_and_ragged_grouped_products_agree_for_any_routing(rows, top_k):
    """From one row (decoding: a block per row) to many (blocks of several rows), on routings that
    leave experts empty or crowd one expert (the padded product then takes a larger capacity)."""
    x = _rows(rows, seed=rows)
    ragged = Mixture(num_experts=8, top_k=top_k, expert_features=8, grouped="ragged_dot")
    variables = ragged.init(jax.random.key(0), x)
    crowded = jax.tree_util.tree_map(lambda v: v, nn.unbox(variables))
    crowded["params"]["gate"] = crowded["params"]["gate"].at[:, 5].add(3.0)  # most rows pick expert 5
    for params in (variables, crowded):
        want = np.asarray(jax.jit(ragged.apply)(params, x))
        for grouped in ("blocks", "padded"):
            got = jax.jit(ragged.clone(grouped=grouped).apply)(params, x)
            np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5, err_msg=grouped)


def test_padded_capacities_are_a_quarter_and_a_half_over_an_even_share():
    assert capacities(2048, 8) == (320, 384)  # share 256
    assert capacities(600, 8) == (96, 120)  # rounded up to whole 8 rows
    assert capacities(3, 8) == (3,)  # fewer assignments than experts: at most all of them


@pytest.mark.parametrize("crowd, empty", [(0.0, 0), (0.0, 30), (3.0, 0), (3.0, 30)],
                         ids=["even", "even-empty-slots", "crowded", "crowded-empty-slots"])
def test_padded_product_matches_blocks_in_value_and_gradient(crowd, empty):
    """Even routings take a capacity, one crowding an expert past 1.5 shares takes blocks;
    rows with id E (an exchange's empty slots) belong to no expert. Biases and GPT-OSS's clamped
    activation go through the hand-written gradient too."""
    experts, assignments, width, features = 6, 300, 16, 12
    keys = jax.random.split(jax.random.key(int(crowd) + empty), 9)
    chosen = jax.random.categorical(keys[0], crowd * (jnp.arange(experts) == 2), shape=(assignments - empty,))
    row_experts = jnp.sort(jnp.concatenate([chosen, jnp.full((empty,), experts)])).astype(jnp.int32)
    sizes = jnp.bincount(row_experts, length=experts).astype(jnp.int32)
    assert (int(sizes.max()) > capacities(assignments, experts)[-1]) == (crowd > 0)  # the branch it names
    shapes = [(experts, width, features)] * 2 + [(experts, features, width), (experts, features),
                                                 (experts, features), (experts, width)]
    kernels = ExpertWeights(*(0.3 * jax.random.normal(k, shape) for k, shape in zip(keys[1:], shapes)))
    rows, target = (jax.random.normal(k, (assignments, width)) for k in keys[7:9])
    valid = (row_experts < experts)[:, None]

    def loss(product, activation=clamped_swiglu):
        def value(rows, kernels):
            out = product(rows, row_experts, sizes, kernels, activation=activation)
            return jnp.sum(((out - target) * valid) ** 2)
        return jax.jit(jax.value_and_grad(value, argnums=(0, 1)))(rows, kernels)

    got, want = loss(padded_experts), loss(blocked_experts)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))
    # negative control: under the plain SwiGLU the kernels' gradients differ
    plain = loss(padded_experts, activation=swiglu)
    assert float(jnp.abs(plain[1][1].gate - want[1][1].gate).max()) > 1e-2 * float(jnp.abs(want[1][1].gate).max())


def test_crowded_routings_take_the_fewest_blocks_that_hold_their_groups(monkeypatch):
    """Past the capacities the padded product takes the fewest of `block_counts` blocks that hold
    every group, and computes what the blocked product computes; a layout one block short loses rows."""
    experts, assignments, width, features = 8, 2048, 8, 8
    block = 2 * block_rows(assignments, experts)
    sizes, counts = capacities(assignments, experts), block_counts(assignments, experts, block)
    assert (block, counts) == (128, (20, 22, 24))  # 16 blocks of assignments, plus 4, 6 or 8 of padding
    keys = jax.random.split(jax.random.key(0), 5)
    kernels = ExpertWeights(*(0.3 * jax.random.normal(k, shape) for k, shape in zip(
        keys[:3], [(experts, width, features)] * 2 + [(experts, features, width)])), None, None, None)
    rows, target = (jax.random.normal(k, (assignments, width)) for k in keys[3:5])
    routings = {  # group sizes -> the layout each takes
        (300, 260, 250, 250, 250, 250, 250, 238): 0,  # the largest group within 1.25 even shares
        (955, 354, 198, 162, 134, 105, 75, 65): len(sizes),  # 8 + 3 + 2 + 2 + 2 + 1 + 1 + 1 = 20 blocks
        (640, 258, 258, 258, 258, 258, 59, 59): len(sizes) + 1,  # 5 + 5 * 3 + 1 + 1 = 22 blocks
        (1025, 129, 129, 129, 129, 129, 129, 249): len(sizes) + 2,  # 9 + 6 * 2 + 2 = 23 blocks
    }
    for group_sizes, want_layout in routings.items():
        group_sizes = jnp.asarray(group_sizes, jnp.int32)
        assert int(group_sizes.sum()) == assignments
        assert int(padded_layout(group_sizes, sizes, counts, block)) == want_layout, group_sizes
        row_experts = jnp.repeat(jnp.arange(experts, dtype=jnp.int32), group_sizes, total_repeat_length=assignments)

        def loss(product):
            def value(rows, kernels):
                return jnp.sum((product(rows, row_experts, group_sizes, kernels) - target) ** 2)
            return jax.jit(jax.value_and_grad(value, argnums=(0, 1)))(rows, kernels)

        got, want = loss(padded_experts), loss(blocked_experts)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))

    # negative control: the fewest blocks (20) for a routing that needs 22 lose rows
    group_sizes = jnp.asarray((640, 258, 258, 258, 258, 258, 59, 59), jnp.int32)
    row_experts = jnp.repeat(jnp.arange(experts, dtype=jnp.int32), group_sizes, total_repeat_length=assignments)
    whole = np.asarray(jax.jit(lambda r: padded_experts(r, row_experts, group_sizes, kernels))(rows))
    monkeypatch.setattr(moe, "padded_layout", lambda *args: jnp.int32(len(sizes)))
    short = np.asarray(jax.jit(lambda r: padded_experts(r, row_experts, group_sizes, kernels))(rows))
    assert np.abs(short - whole).max() > 1e-2 * np.abs(whole).max()


def test_auto_pads_by_expert_on_the_cpu_from_32_assignments_per_expert():
    """Training batches take the padded product (a switch over capacities), decoding the blocks."""
    layer = Mixture(num_experts=4, top_k=2, expert_features=8)

    def switches(rows):
        x = _rows(rows)
        jaxpr = jax.make_jaxpr(layer.apply)(layer.init(jax.random.key(0), x), x)
        return "cond" in str(jaxpr)

    assert switches(64) and not switches(63)  # 128 assignments over 4 experts: 32 each


def test_the_router_records_its_statistics_only_when_asked():
    layer = Mixture(num_experts=4, top_k=3, expert_features=8)
    rows = _rows(20)
    variables = layer.init(jax.random.key(0), rows)
    assert set(variables) == {"params"}  # init records nothing
    _, recorded = layer.apply(variables, rows, mutable=["router"])
    metrics = router_metrics(recorded["router"])
    tokens = np.asarray([metrics[f"expert_{e}_tokens"] for e in range(4)])
    assert tokens.sum() == 20 * 3 and (tokens <= 20).all()  # each row picks 3 distinct experts
    logits = np.asarray(rows @ nn.unbox(variables)["params"]["gate"], np.float64)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(float(metrics["z"]), np.mean(lse ** 2), rtol=1e-5)
    probs = np.exp(logits - lse[:, None])
    chosen = np.argsort(-probs, axis=-1)[:, :3]
    share = np.bincount(chosen.ravel(), minlength=4) / 20
    np.testing.assert_allclose(float(metrics["balance"]), 4 * np.sum(share * probs.mean(0)), rtol=1e-5)
    assert router_metrics({}) == {}


def _model(**overrides):
    settings = dict(vocab_size=64, emb_features=32, num_layers=3, num_heads=4, num_kv_heads=2, max_seq_len=16,
                    mlp_features=40, qk_norm=False, qkv_bias=True,
                    mixture={"num_experts": 4, "top_k": 2, "expert_features": 16, "normalize_top_k": True})
    settings.update(overrides)
    return CausalTransformer(**settings)


def _ids(batch=2, length=10, seed=0):
    return np.random.default_rng(seed).integers(0, 64, size=(batch, length)).astype(np.int32)


def test_a_layer_plan_mixes_dense_and_mixture_feed_forwards():
    model = _model(first_k_dense=1)
    assert model.mlp_plan == ("dense", "mixture", "mixture")
    params = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), _ids()))["params"]
    assert set(params["layers_0"]["mlp"]) == {"gate_proj", "up_proj", "down_proj"}
    assert params["layers_1"]["mlp"]["experts"]["gate_proj"].shape == (4, 32, 16)
    assert params["layers_2"]["mlp"]["gate"].shape == (32, 4)
    attention = params["layers_0"]["self_attn"]
    assert "bias" in attention["q_proj"] and "bias" in attention["v_proj"] and "bias" not in attention["o_proj"]
    explicit = _model(mlp_layer_types=("mixture", "dense", "mixture"))
    assert explicit.mlp_plan == ("mixture", "dense", "mixture")
    assert _model().mlp_plan == ("mixture",) * 3 and _model(mixture=None).mlp_plan == ("dense",) * 3


def test_scanned_mixture_layers_compute_what_unrolled_ones_do():
    model, scanned = _model(), _model(scan_layers=True)
    variables = nn.unbox(model.init(jax.random.key(0), _ids()))
    stacked = {"params": {**{k: v for k, v in variables["params"].items() if not k.startswith("layers_")},
                          "layers": jax.tree_util.tree_map(lambda *x: jnp.stack(x),
                                                           *[variables["params"][f"layers_{i}"] for i in range(3)])}}
    ids = _ids()
    out, recorded = model.apply(variables, ids, mutable=["router"])
    out_scanned, recorded_scanned = scanned.apply(stacked, ids, mutable=["router"])
    np.testing.assert_allclose(np.asarray(out_scanned), np.asarray(out), atol=1e-5)
    a, b = router_metrics(recorded["router"]), router_metrics(recorded_scanned["router"])
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_allclose(float(b[name]), float(a[name]), rtol=1e-5)


def test_mixture_layers_decode_from_the_cpu_decode_layout_and_generate_alike():
    model = _model(first_k_dense=1)
    variables = nn.unbox(model.init(jax.random.key(0), _ids()))
    decoder, converted = decode_layout(model, variables)
    assert "experts" in converted["params"]["layers_1"]["mlp"]  # mixture parameters stay as they are
    assert "gate_up_proj" in converted["params"]["layers_0"]["mlp"]
    assert "qkv_proj" in converted["params"]["layers_0"]["self_attn"]
    ids = _ids()
    np.testing.assert_allclose(np.asarray(decoder.apply(converted, ids)), np.asarray(model.apply(variables, ids)),
                               atol=1e-5)
    greedy = Sampling(temperature=0.0)
    one = generate(model, variables, ids[:1, :4], 6, key=jax.random.key(0), sampling=greedy).host()
    both = generate(model, variables, ids[:, :4], 6, key=jax.random.key(0), sampling=greedy).host()
    np.testing.assert_array_equal(np.asarray(one.tokens)[0], np.asarray(both.tokens)[0])


def test_lm_objective_logs_router_metrics_and_adds_the_weighted_losses():
    model = _model(first_k_dense=1)
    variables = model.init(jax.random.key(0), _ids())
    batch = {"text": jnp.asarray(_ids(4, 11))}
    plain = LMObjective(model, seq_len=10)
    weighted = LMObjective(model, seq_len=10, balance_coef=0.5, z_loss_coef=0.25)
    loss, aux = plain.loss(variables, batch, None)
    loss_weighted, aux_weighted = weighted.loss(variables, batch, None)
    m = aux.metrics
    assert float(loss) == pytest.approx(float(m["cross_entropy"]))
    np.testing.assert_allclose(float(loss_weighted),
                               float(m["cross_entropy"] + 0.5 * m["router/balance"] + 0.25 * m["router/z"]), rtol=1e-6)
    per_layer = sum(float(m[f"router/expert_{e}_tokens"]) for e in range(4))
    assert per_layer == 4 * 10 * 2  # every token's two choices, averaged over the two mixture layers
    assert "router/balance" not in LMObjective(_model(mixture=None), seq_len=10).loss(
        nn.unbox(_model(mixture=None).init(jax.random.key(0), _ids())), batch, None)[1].metrics


def test_the_trainer_updates_router_and_experts():
    from dew import Dataset, Trainer

    model = _model(first_k_dense=1)
    rows = np.random.default_rng(0).integers(0, 64, size=(16, 11)).astype(np.int32)
    trainer = Trainer(LMObjective(model, seq_len=10, balance_coef=0.01), optax.adam(1e-2), key=jax.random.key(0))
    initial = nn.unbox(trainer.objective.init(jax.random.split(jax.random.key(0))[0]))
    state = trainer.fit(Dataset.from_records({"text": rows}, batch=8), steps=1, log_every=1)
    assert "router/balance" in trainer.history[-1] and "router/expert_3_tokens" in trainer.history[-1]
    before, after = initial["params"]["layers_1"]["mlp"], nn.unbox(state.variables)["params"]["layers_1"]["mlp"]
    for path in (("gate",), ("experts", "down_proj")):
        a, b = before, after
        for key in path:
            a, b = a[key], b[key]
        assert not np.allclose(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(num_experts=4, top_k=5, expert_features=8), "top_k=5 is larger than num_experts=4"),
        (dict(num_experts=4, top_k=2, expert_features=8, score="tanh"), "score='tanh' is not implemented"),
        (dict(num_experts=6, top_k=2, expert_features=8, groups=4), "groups=4 does not divide num_experts=6"),
        (dict(num_experts=8, top_k=2, expert_features=8, groups=8), "leaves 1 expert"),
        (dict(num_experts=8, top_k=3, expert_features=8, groups=4, group_top_k=1), "fewer than top_k=3"),
        (dict(num_experts=8, top_k=2, expert_features=8, groups=2, group_top_k=3), "group_top_k=3 is larger"),
        (dict(num_experts=4, top_k=2, expert_features=8, dispatch="gather"),
         "dispatch='gather' is not implemented"),
        (dict(num_experts=0, top_k=2, expert_features=8), "num_experts must be a positive integer"),
        (dict(num_experts=4, top_k=2, expert_features=8, shared_expert_gate=True), "needs a shared expert"),
        (dict(num_experts=4, top_k=2, expert_features=8, grouped="dense"), "grouped='dense' is not one of"),
    ],
)
def test_bad_mixture_settings_are_refused_before_anything_runs(settings, message):
    with pytest.raises(ValueError, match=message):
        Mixture(**settings)
    with pytest.raises(ValueError, match=message):
        _model(mixture=settings)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(first_k_dense=1, scan_layers=True), "same feed-forward"),
        (dict(mixture=None, mlp_layer_types=("dense", "mixture", "dense")), "no mixture is set"),
        (dict(mlp_layer_types=("dense", "moe", "dense")), "unknown mlp layer type 'moe'"),
        (dict(mlp_layer_types=("dense", "mixture")), "names 2 layers but num_layers=3"),
        (dict(first_k_dense=4), "more than num_layers=3"),
        (dict(mixture={"num_experts": 4, "top_k": 2, "expert_features": 8, "num_layers": 2}), "must not set"),
    ],
)
def test_bad_layer_plans_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        _model(**overrides)


def test_dpo_trains_a_mixture_policy_unchanged():
    """Post-training objectives call the model as they call a dense one; its routing is not logged."""
    import json

    from dew import Trainer
    from dew.data import ByteTokenizer, Loading, PreferencePairs
    from dew.objectives.rl import DPOObjective

    tokenizer = ByteTokenizer()
    prompt, chosen, rejected = tokenizer.encode("Tom:"), tokenizer.encode(" a dog"), tokenizer.encode(" no")
    pair = {"chosen": prompt + chosen, "rejected": prompt + rejected,
            "chosen_mask": [0] * len(prompt) + [1] * len(chosen),
            "rejected_mask": [0] * len(prompt) + [1] * len(rejected)}
    model = _model(vocab_size=256, max_seq_len=32, num_layers=2)
    start = {"params": nn.unbox(jax.jit(model.init)(jax.random.key(0), _ids()))["params"]}
    pairs = PreferencePairs(records=(json.dumps(pair),) * 8, seq_len=16,
                            loading=Loading(workers=0, threads=1, read_buffer=2)).load(batch=8)
    objective = DPOObjective(model, seq_len=15, beta=0.1, variables=start)
    trainer = Trainer(objective, optax.adam(3e-3), key=jax.random.key(2))
    trainer.fit(pairs, steps=6, log_every=3)
    assert trainer.history[-1]["loss"] < trainer.history[0]["loss"]


def _gpt_oss_reference(params, rows, top_k, limit=7.0, alpha=1.702, interleaved=True):
    """transformers' GptOssMLP row by row in NumPy: the k largest biased router logits and their
    softmax; each expert's fused gate_up (gate in the even columns) with its bias, the clamped
    SwiGLU ``(up + 1) * gate * sigmoid(alpha * gate)``, and the biased down projection."""
    rows = np.asarray(rows, np.float64)
    p = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)
    e = p["experts"]
    logits = rows @ p["gate"] + p["gate_bias"]
    out = np.zeros_like(rows)
    for t, row in enumerate(rows):
        chosen = np.argsort(-logits[t])[:top_k]
        weights = np.exp(logits[t, chosen] - logits[t, chosen].max())
        weights /= weights.sum()
        for expert, w in zip(chosen, weights):
            gate_up = row @ e["gate_up_proj"][expert] + e["gate_up_proj_bias"][expert]
            if interleaved:
                gate, up = gate_up[0::2], gate_up[1::2]
            else:
                gate, up = np.split(gate_up, 2)
            gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
            hidden = (up + 1) * gate / (1.0 + np.exp(-alpha * gate))
            out[t] += w * (hidden @ e["down_proj"][expert] + e["down_proj_bias"][expert])
    return out


GPT_OSS_MIXTURE = dict(normalize_top_k=True, router_bias=True, expert_bias=True, activation="clamped_swiglu",
                       gate_up="interleaved")


@pytest.mark.parametrize("grouped", ["ragged_dot", "blocks", "padded"])
def test_gpt_oss_experts_match_transformers_clamped_biased_interleaved_experts(grouped):
    layer = Mixture(num_experts=6, top_k=3, expert_features=10, grouped=grouped, **GPT_OSS_MIXTURE)
    rows = 4.0 * _rows()  # wide enough that the clamp at 7 cuts gates and ups
    params = _params(layer, rows)
    params["experts"] = {name: 8.0 * value for name, value in params["experts"].items()}
    assert set(params["experts"]) == {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}
    got = np.asarray(layer.apply({"params": params}, rows))
    want = _gpt_oss_reference(params, rows, 3)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
    # negative controls: without the clamp, or reading gate and up as halves, the result differs
    assert np.abs(got - _gpt_oss_reference(params, rows, 3, limit=1e9)).max() > 1e-2
    assert np.abs(got - _gpt_oss_reference(params, rows, 3, interleaved=False)).max() > 1e-2
    plain = layer.clone(activation="swiglu")
    assert np.abs(np.asarray(plain.apply({"params": params}, rows)) - want).max() > 1e-2


def test_separate_expert_kernels_take_biases_too():
    layer = Mixture(num_experts=4, top_k=2, expert_features=8, expert_bias=True, normalize_top_k=True)
    params = nn.unbox(layer.init(jax.random.key(0), _rows()))["params"]
    shapes = {name: value.shape for name, value in params["experts"].items()}
    assert shapes == {"gate_proj": (4, WIDTH, 8), "up_proj": (4, WIDTH, 8), "down_proj": (4, 8, WIDTH),
                      "gate_proj_bias": (4, 8), "up_proj_bias": (4, 8), "down_proj_bias": (4, WIDTH)}
    moved = dict(params, experts=dict(params["experts"], down_proj_bias=params["experts"]["down_proj_bias"] + 1.0))
    # with every expert's output bias moved by one, each row moves by the sum of its weights: one
    shift = layer.apply({"params": moved}, _rows()) - layer.apply({"params": params}, _rows())
    np.testing.assert_allclose(np.asarray(shift), 1.0, atol=1e-5)
    with pytest.raises(ValueError, match="activation='gelu' is not one of"):
        Mixture(num_experts=4, top_k=2, expert_features=8, activation="gelu")
    with pytest.raises(ValueError, match="gate_up='fused' is not one of"):
        Mixture(num_experts=4, top_k=2, expert_features=8, gate_up="fused")
