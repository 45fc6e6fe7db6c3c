"""DeepSeek-V3's auxiliary-loss-free balancing (arXiv:2412.19437, section 2.1.2) as a training step runs it.

The routers' ``score_bias`` sits in the ``balance`` collection: no gradient, no optimizer state, no
weight decay. ``LMObjective(bias_update_rate=gamma)`` moves it after each step by
``gamma * sign(mean_load - load_e)`` from the tokens each layer routed in that step.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Checkpoints, Dataset, Trainer
from dew.nn.backbones.causal_transformer import CausalTransformer
from dew.nn.moe import ROUTER_COLLECTION, balanced_score_bias
from dew.objectives.lm import LMObjective

SEQ_LEN = 8
EXPERTS = 4
# experts 0 and 1 start far ahead: sigmoid scores of a fresh router sit near 0.5, so every row
# picks them (top-2) until the rule closes the gap
UNBALANCED = np.array([0.4, 0.4, 0.0, 0.0], np.float32)


def _model(scan_layers=False):
    return CausalTransformer(
        vocab_size=32, emb_features=16, num_layers=2, num_heads=2, head_dim=8, mlp_features=16,
        max_seq_len=SEQ_LEN, scan_layers=scan_layers,
        mixture=dict(num_experts=EXPERTS, top_k=2, expert_features=8, score="sigmoid", score_bias=True,
                     normalize_top_k=True),
    )


def _rows(n=16, seed=0):
    return np.random.default_rng(seed).integers(0, 32, size=(n, SEQ_LEN + 1)).astype(np.int32)


def _unbalanced_variables(model):
    variables = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, SEQ_LEN), jnp.int32)))
    variables["balance"] = jax.tree_util.tree_map(lambda b: jnp.broadcast_to(UNBALANCED, b.shape), variables["balance"])
    return variables


def _biases(variables):
    return {"/".join(str(k.key) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(variables["balance"])[0]}


def test_the_rule_moves_each_bias_by_the_sign_of_its_load_gap():
    balance = {"layers_0": {"mlp": {"score_bias": jnp.array([0.5, 0.0, -0.25, 0.0])}}}
    recorded = {"layers_0": {"mlp": {"expert_tokens": (jnp.array([6.0, 1.0, 3.0, 2.0]),)}}}  # mean 3
    moved = balanced_score_bias(balance, recorded, 0.125)
    np.testing.assert_array_equal(np.asarray(moved["layers_0"]["mlp"]["score_bias"]),
                                  [0.5 - 0.125, 0.125, -0.25, 0.125])
    # a scanned stack moves each layer by its own counts
    stacked = {"layers": {"mlp": {"score_bias": jnp.zeros((2, 3))}}}
    counts = {"layers": {"mlp": {"expert_tokens": (jnp.array([[4.0, 1.0, 1.0], [0.0, 3.0, 3.0]]),)}}}
    np.testing.assert_array_equal(np.asarray(balanced_score_bias(stacked, counts, 1.0)["layers"]["mlp"]["score_bias"]),
                                  [[-1.0, 1.0, 1.0], [1.0, -1.0, -1.0]])
    with pytest.raises(ValueError, match="no expert_tokens recorded"):
        balanced_score_bias(balance, {}, 0.1)


def test_one_step_moves_the_bias_by_the_counts_it_routed_and_keeps_it_out_of_the_optimizer():
    model, rows = _model(), _rows()
    start = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, SEQ_LEN), jnp.int32)))  # a fresh, uneven router
    gamma = 0.01
    # the counts each layer records for the batch under the starting weights (the step's own pass)
    _, recorded = model.apply(start, jnp.asarray(rows[:, :-1]), mutable=[ROUTER_COLLECTION])
    want, flipped = {}, {}
    for layer in ("layers_0", "layers_1"):
        load = np.asarray(recorded[ROUTER_COLLECTION][layer]["mlp"]["expert_tokens"][0])
        assert load.sum() == 2 * rows.shape[0] * SEQ_LEN  # every token went to top_k = 2 experts
        assert len(set(load.tolist())) > 1  # some experts over, some under the mean
        want[f"{layer}/mlp/score_bias"] = gamma * np.sign(load.mean() - load)
        flipped[f"{layer}/mlp/score_bias"] = -want[f"{layer}/mlp/score_bias"]
    # weight decay as strong as it gets: it would pull a parameter halfway to zero in one step
    optimizer = optax.adamw(1e-3, weight_decay=500.0)
    objective = LMObjective(model, SEQ_LEN, variables=start, bias_update_rate=gamma)
    trainer = Trainer(objective, optimizer, key=jax.random.key(1))
    state = trainer.fit(Dataset.from_records({"text": rows}, batch=16), steps=1, log_every=1)
    got = _biases(state.variables)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-7)
        assert np.abs(got[name] - flipped[name]).max() > gamma  # negative control: the opposite sign
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]]
    assert paths and not any("score_bias" in p or "balance" in p for p in paths)

    unbalanced = _unbalanced_variables(model)
    still = Trainer(LMObjective(model, SEQ_LEN, variables=unbalanced), optimizer, key=jax.random.key(1))
    kept = still.fit(Dataset.from_records({"text": rows}, batch=16), steps=1, log_every=1)
    for name, bias in _biases(kept.variables).items():  # gamma = 0: neither the loss nor the decay moves it
        np.testing.assert_array_equal(bias, UNBALANCED)


def _spread(history):
    """max / mean of the last step's per-expert token counts (1.0 is perfectly even)."""
    counts = np.array([history[-1][f"router/expert_{e}_tokens"] for e in range(EXPERTS)])
    return counts.max() / counts.mean()


def test_balancing_evens_out_an_unbalanced_router_and_resumes_exactly(tmp_path):
    model, rows = _model(), _rows(32)
    start = _unbalanced_variables(model)
    steps, gamma = 6, 0.05

    def trainer(rate, checkpoints=None):
        objective = LMObjective(model, SEQ_LEN, variables=start, bias_update_rate=rate)
        return Trainer(objective, optax.adam(1e-3), key=jax.random.key(2), checkpoints=checkpoints)

    data = Dataset.from_records({"text": rows}, batch=16)
    balancing = trainer(gamma)
    balanced = balancing.fit(data, steps=steps, log_every=1)
    control = trainer(0.0)
    control.fit(data, steps=steps, log_every=1)
    assert _spread(control.history) == pytest.approx(2.0)  # experts 0 and 1 still take every token
    assert _spread(balancing.history) < 1.5
    assert _spread(balancing.history) < _spread(balancing.history[:1])

    checkpoints = Checkpoints(tmp_path / "ckpt")
    trainer(gamma, checkpoints).fit(data, steps=3, log_every=1, checkpoint_every=3)
    saved, _, _ = Checkpoints(tmp_path / "ckpt").restore_variables()  # the bias is part of what a step holds
    assert sorted(_biases(saved)) == sorted(_biases(balanced.variables))
    assert not any(np.array_equal(bias, UNBALANCED) for bias in _biases(saved).values())
    resumed = trainer(gamma, Checkpoints(tmp_path / "ckpt")).fit(data, steps=steps, log_every=1, checkpoint_every=3)
    for name, bias in _biases(balanced.variables).items():
        np.testing.assert_array_equal(_biases(resumed.variables)[name], bias)
    for a, b in zip(jax.tree_util.tree_leaves(balanced.variables["params"]),
                    jax.tree_util.tree_leaves(resumed.variables["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_rate_without_a_balancing_bias_is_refused():
    model = _model().clone(mixture=dict(num_experts=EXPERTS, top_k=2, expert_features=8))
    trainer = Trainer(LMObjective(model, SEQ_LEN, bias_update_rate=0.01), optax.adam(1e-3), key=jax.random.key(0))
    with pytest.raises(ValueError, match="no 'balance' collection"):
        trainer.fit(Dataset.from_records({"text": _rows()}, batch=16), steps=1)
    with pytest.raises(ValueError, match="bias_update_rate must be a number >= 0"):
        LMObjective(model, SEQ_LEN, bias_update_rate=-1.0)
