"""The tensor axis splits heads, MLP and vocabulary for activations as for weights: the same losses as
one device, and the compiled step of a tensor run exchanges only partial sums (Megatron's all-reduces
after the attention and MLP output projections, and the loss's per-token reductions over the split
vocabulary), never gathering the full logits."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import MeshSpec, Trainer
from dew.data import Dataset
from dew.nn.backbones import CausalTransformer
from dew.objectives.lm import LMObjective
from dew.training import Layout

VOCAB, LAYERS = 512, 2
BATCH = {"text": np.random.default_rng(0).integers(0, VOCAB, (8, 33)).astype(np.int32)}


def trainer(mesh):
    model = CausalTransformer(vocab_size=VOCAB, emb_features=64, num_layers=LAYERS, num_heads=4, mlp_features=128,
                              max_seq_len=64, tie_embeddings=False)
    return Trainer(LMObjective(model, seq_len=32), optax.adam(1e-3), key=jax.random.key(0), mesh=mesh,
                   layout=Layout(min_shard=1))


def collectives(t):
    hlo = t.compiled_step().lower(t._abstract_with_shardings(), {"text": jax.ShapeDtypeStruct((8, 33), jnp.int32)}).compile().as_text()
    found = re.findall(r"= (\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(", hlo)
    return collections.Counter((kind, shape.split("{")[0]) for shape, kind in found)


@pytest.fixture(scope="module")
def single_device_losses():
    t = trainer(MeshSpec())
    t.fit(Dataset.from_records(BATCH, batch=8), steps=5, log_every=1)
    return [row["loss"] for row in t.history]


@pytest.mark.parametrize("mesh", [MeshSpec(tensor=4), MeshSpec(fsdp=2, tensor=2)], ids=["tensor4", "fsdp2-tensor2"])
def test_tensor_runs_train_like_one_device(mesh, single_device_losses):
    t = trainer(mesh)
    t.fit(Dataset.from_records(BATCH, batch=8), steps=5, log_every=1)
    np.testing.assert_allclose([row["loss"] for row in t.history], single_device_losses, rtol=1e-5)
    assert not any(kind == "all-gather" and str(VOCAB) in shape for kind, shape in collectives(t))


def test_a_tensor_step_exchanges_only_partial_sums():
    found = collectives(trainer(MeshSpec(tensor=4)))
    assert {kind for kind, _ in found} == {"all-reduce"}
    # one [tokens, embed] all-reduce after each block's attention and MLP output projection, in the
    # forward pass and again for the input gradients of the backward pass; the 8 x 32 tokens are
    # split over the data axis (tensor=4 leaves data=2), so each device reduces its 128 rows
    assert found[("all-reduce", "f32[128,64]")] == 2 * LAYERS
    assert found[("all-reduce", "f32[256,64]")] == 0  # no device computes the other half's rows
    assert all(str(VOCAB) not in shape for _, shape in found)  # no logits-sized exchange at all
