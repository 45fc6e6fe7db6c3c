"""The sequence axis splits token activations along their length: the same losses as without it, with
attention exchanging data by Ulysses all-to-alls or a key/value gather, and a compiled step in which no
device holds a whole sequence's activations."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Aux, Field, InputSpec, MeshSpec, Objective, Trainer
from dew.data import Dataset
from dew.nn import sequence_parallel
from dew.nn.attention import dot_product_attention
from dew.nn.backbones import CausalTransformer
from dew.nn.backbones.layer_plan import LayerKind
from dew.nn.sequence_parallel import SequenceSplit, choose_exchange, exchange_bytes, splitting
from dew.objectives.lm import LMObjective
from dew.training import Layout
from dew.training import mesh as mesh_lib

# sizes chosen so no two activation shapes coincide: 8 rows of 32 positions, width 48, 4 heads of 12
VOCAB, WIDTH, LENGTH, ROWS = 96, 48, 32, 8


def packed_batch():
    """Two documents per row, boundaries differing by row; positions restart at each document."""
    rng = np.random.default_rng(0)
    starts = rng.integers(5, LENGTH - 4, ROWS)
    index = np.arange(LENGTH + 1)[None, :]
    second = index >= starts[:, None]
    return {
        "text": rng.integers(0, VOCAB, (ROWS, LENGTH + 1)).astype(np.int32),
        "segment_ids": np.where(second, 2, 1).astype(np.int32),
        "positions": np.where(second, index - starts[:, None], index).astype(np.int32),
    }


BATCH = packed_batch()


def trainer(mesh, exchange="auto"):
    """A decoder with one causal and one sliding-window layer (window 5, shorter than a device's share)."""
    model = CausalTransformer(
        vocab_size=VOCAB, emb_features=WIDTH, num_layers=2, num_heads=4, mlp_features=80, max_seq_len=64,
        layer_types=("full_attention", "sliding_attention"), kinds={"sliding_attention": LayerKind(window=5)},
    )
    return Trainer(LMObjective(model, seq_len=LENGTH), optax.adam(1e-3), key=jax.random.key(0), mesh=mesh,
                   layout=Layout(min_shard=1, sequence_exchange=exchange))


def fit(t):
    t.fit(Dataset.from_records(BATCH, batch=ROWS), steps=5, log_every=1)
    return [row["loss"] for row in t.history]


def compiled_text(t):
    """The compiled train step's HLO for batches placed as `fit` places them."""
    shapes = {name: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=t._batch_sharding(value.shape))
              for name, value in BATCH.items()}
    return t.compiled_step().lower(t._abstract_with_shardings(), shapes).compile().as_text()


def whole_sequence_activations(hlo, rows):
    """Shapes in the compiled step that hold all LENGTH positions of `rows` rows at the model's width."""
    wanted = {f"f32[{rows},{LENGTH},{WIDTH}]", f"f32[{rows * LENGTH},{WIDTH}]"}
    return wanted & set(re.findall(r"f32\[[0-9,]+\]", hlo))


@pytest.fixture(scope="module")
def unsplit_losses():
    return fit(trainer(MeshSpec()))


@pytest.mark.parametrize(
    "mesh, exchange, rows",  # rows: the batch rows each device holds
    [(MeshSpec(sequence=4), "ulysses", 4), (MeshSpec(sequence=4), "gather", 4),
     (MeshSpec(fsdp=2, tensor=2, sequence=2), "ulysses", 4)],
    ids=["sequence4-ulysses", "sequence4-gather", "fsdp2-tensor2-sequence2"],
)
def test_split_sequences_train_like_unsplit_ones(mesh, exchange, rows, unsplit_losses):
    t = trainer(mesh, exchange)
    np.testing.assert_allclose(fit(t), unsplit_losses, rtol=1e-5)
    hlo = compiled_text(t)
    assert not whole_sequence_activations(hlo, rows)
    all_to_alls = len(re.findall(r" all-to-all\(", hlo))
    # keys/values [rows, LENGTH, heads on a device, head_dim] exist only when gathered
    gathered = re.findall(rf"f32\[{rows},{LENGTH},\d+,12\][^ ]* all-gather\(", hlo)
    if exchange == "ulysses":
        assert all_to_alls > 0 and not gathered
    else:
        assert all_to_alls == 0 and gathered


def test_the_activation_check_finds_whole_sequences_when_nothing_splits_them(monkeypatch):
    monkeypatch.setattr(mesh_lib, "sequence_split", lambda mesh, layout: None)
    assert whole_sequence_activations(compiled_text(trainer(MeshSpec(sequence=4))), 4)


def test_split_attention_equals_plain_attention_on_both_paths():
    """GQA with fewer kv heads than devices (repeated for Ulysses), a window given as a traced layer
    value, and packed segments: each path returns what plain attention returns."""
    mesh = MeshSpec(sequence=4).build()  # data=2 x sequence=4
    q, k, v = (jax.random.normal(key, shape) for key, shape in zip(
        jax.random.split(jax.random.key(1), 3), [(2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, 8)]))
    segments = jnp.asarray(np.where(np.arange(16) < [[6], [11]], 1, 2), jnp.int32)
    plain = dot_product_attention(q, k, v, causal=True, window=3, segment_ids=segments)
    for exchange in ("ulysses", "gather"):
        def split(q, k, v, segments, window):
            with splitting(SequenceSplit(mesh, mesh_lib.BATCH_AXES, exchange=exchange)):
                return sequence_parallel.attention(q, k, v, causal=True, window=window, segment_ids=segments)

        out = jax.jit(split)(q, k, v, segments, jnp.asarray(3))
        np.testing.assert_allclose(out, plain, atol=2e-6)
        windowless = jax.jit(split)(q, k, v, segments, jnp.asarray(0))  # a traced 0 switches the window off
        assert np.abs(windowless - plain).max() > 1e-2  # the window mattered: the comparison can fail


def test_split_attention_keeps_each_heads_sink_on_both_paths():
    """GPT-OSS's per-head sinks: each device's heads (after Ulysses' exchange) keep their own sink."""
    mesh = MeshSpec(sequence=4).build()
    q, k, v = (jax.random.normal(key, shape) for key, shape in zip(
        jax.random.split(jax.random.key(2), 3), [(2, 16, 8, 8), (2, 16, 4, 8), (2, 16, 4, 8)]))
    sinks = jnp.linspace(-2.0, 3.0, 8)
    plain = dot_product_attention(q, k, v, causal=True, sinks=sinks)
    for exchange in ("ulysses", "gather"):
        def split(q, k, v, sinks):
            with splitting(SequenceSplit(mesh, mesh_lib.BATCH_AXES, exchange=exchange)):
                return sequence_parallel.attention(q, k, v, causal=True, sinks=sinks)

        np.testing.assert_allclose(jax.jit(split)(q, k, v, sinks), plain, atol=2e-6)
        assert np.abs(jax.jit(split)(q, k, v, sinks[::-1]) - plain).max() > 1e-2  # heads' sinks swapped: caught


def test_auto_takes_the_exchange_that_moves_fewer_bytes():
    split = SequenceSplit(MeshSpec(sequence=4).build(), mesh_lib.BATCH_AXES)
    sizes = dict(rows=32, head_dim=12, itemsize=4)
    # one device's 32 rows of 12-wide heads, 4 bytes each: Ulysses sends 3/4 of q, k, v and the output
    assert exchange_bytes("ulysses", heads=4, kv_heads=4, size=4, **sizes) == 3 * 32 * 12 * 4 * 16 // 4
    assert exchange_bytes("gather", heads=4, kv_heads=4, size=4, **sizes) == 3 * 32 * 12 * 4 * 8
    assert choose_exchange(split, heads=4, kv_heads=4, **sizes) == "ulysses"
    # 8 query heads sharing one kv head: the kv heads repeat to 4, and gathering one kv head is cheaper
    assert choose_exchange(split, heads=8, kv_heads=1, **sizes) == "gather"
    # 6 heads do not split over 4 devices: only the gather can run
    assert choose_exchange(split, heads=6, kv_heads=6, **sizes) == "gather"


def test_splits_that_do_not_fit_raise_naming_what_and_by_how_much():
    mesh = MeshSpec(sequence=4).build()
    forced = SequenceSplit(mesh, mesh_lib.BATCH_AXES, exchange="ulysses")
    with pytest.raises(ValueError, match=r"6 query heads on each device do not split over sequence=4: 6 % 4 = 2"):
        choose_exchange(forced, rows=8, heads=6, kv_heads=6, head_dim=8, itemsize=4)
    t = Trainer(LMObjective(CausalTransformer(vocab_size=VOCAB, emb_features=32, num_layers=1, num_heads=4,
                                              max_seq_len=64), seq_len=30),
                optax.adam(1e-3), key=jax.random.key(0), mesh=MeshSpec(sequence=4))
    batch = {"text": np.zeros((ROWS, 31), np.int32)}
    with pytest.raises(ValueError, match=r"30 tokens does not split over MeshSpec\(sequence=4\): 30 % 4 = 2.*"
                                         r"2 more tokens, 32"):
        t.fit(Dataset.from_records(batch, batch=ROWS), steps=1)
    with pytest.raises(ValueError, match="sequence_exchange='ring' is not a sequence-parallel exchange"):
        Layout(sequence_exchange="ring")


class Regression(Objective):
    """An objective whose model has no sequence to split."""

    model = nn.Dense(1)
    inputs = InputSpec(Field("x", (4,)))

    def init(self, key, variables=None):
        return self.model.init(key, jnp.ones((1, 4)))

    def loss(self, variables, batch, step):
        return jnp.mean(self.model.apply(variables, batch["x"]) ** 2), Aux()


def test_a_sequence_axis_that_no_model_splits_is_refused():
    t = Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0), mesh=MeshSpec(sequence=2))
    with pytest.raises(ValueError, match=r"MeshSpec\(sequence=2\).*Regression's model splits none.*sequence=1"):
        t.fit(Dataset.from_records({"x": np.ones((8, 4), np.float32)}, batch=8), steps=1)
    unsplit = Trainer(Regression(), optax.sgd(0.1), key=jax.random.key(0), mesh=MeshSpec())
    unsplit.fit(Dataset.from_records({"x": np.ones((8, 4), np.float32)}, batch=8), steps=1)  # no axis: no complaint
