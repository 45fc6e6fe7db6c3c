"""State and residuals in pinned host memory: Layout(host=...) and the offloaded remat policies.

XLA:CPU addresses a pinned_host memory, so the paths run here: training is unchanged, the state
parts live in host memory between steps (and across a checkpoint), and the compiled step carries
the moves. (XLA:CPU's memory analysis does not count host bytes apart, so the device bytes saved
are measured on an accelerator.)"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Checkpoints, MeshSpec, Trainer
from dew.data import Dataset
from dew.nn.backbones import CausalTransformer
from dew.objectives.lm import LMObjective
from dew.training import Layout

BATCH = {"text": np.random.default_rng(0).integers(0, 64, (8, 17)).astype(np.int32)}


def decoder(**settings):
    return CausalTransformer(vocab_size=64, emb_features=32, num_layers=2, num_heads=2, mlp_features=64,
                             max_seq_len=32, **settings)


def trainer(layout=Layout(), checkpoints=None, **settings):
    return Trainer(LMObjective(decoder(**settings), seq_len=16, ema_decay=0.9), optax.adam(1e-2), key=jax.random.key(0),
                   mesh=MeshSpec(fsdp=2), layout=layout, checkpoints=checkpoints)


def losses(t, steps, **fit):
    t.fit(Dataset.from_records(BATCH, batch=8), steps=steps, log_every=1, **fit)
    return [row["loss"] for row in t.history]


def memory_kinds(tree):
    return {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(tree)}


def test_optimizer_state_and_ema_kept_in_host_memory_train_the_same(tmp_path):
    expected = losses(trainer(), 5)
    host = Layout(host=("opt_state", "ema"), min_shard=1)
    first = trainer(host, Checkpoints(tmp_path))
    assert losses(first, 3, checkpoint_every=3) == expected[:3]
    state = first.fit(Dataset.from_records(BATCH, batch=8), steps=3)
    assert memory_kinds(state.opt_state) == memory_kinds(state.ema) == {"pinned_host"}
    assert memory_kinds(state.params) == {"device"}
    resumed = trainer(host, Checkpoints(tmp_path))  # restored into host memory
    assert losses(resumed, 5) == expected[3:]
    compiled = resumed.compiled_step().lower(resumed._abstract_with_shardings(),
                                             {"text": jax.ShapeDtypeStruct((8, 17), jnp.int32)}).compile().as_text()
    assert "S(5)" in compiled  # XLA's host memory space, on the moved arguments and results
    with pytest.raises(ValueError, match="opt_state', 'ema'"):
        Layout(host=("params",))


def test_offloaded_remat_policies_compute_the_same_and_move_residuals_to_host():
    expected = losses(trainer(scan_layers=True), 3)
    batch = {"text": jax.ShapeDtypeStruct((8, 17), jnp.int32)}
    kept = trainer(scan_layers=True, remat="minimal")
    assert "annotate_device_placement" not in kept.compiled_step().lower(kept._abstract_with_shardings(), batch).as_text()
    for policy in ("minimal_offloaded", "save_qkv_proj_offloaded"):
        t = trainer(scan_layers=True, remat=policy)
        np.testing.assert_allclose(losses(t, 3), expected, rtol=1e-6)
        assert "annotate_device_placement" in t.compiled_step().lower(t._abstract_with_shardings(), batch).as_text()
