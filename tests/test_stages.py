"""The stage axis: a decoder's layer stack as GPipe stages over microbatches trains as one device does,
with weights and optimizer state replicated over the stages and the stages handing activations on."""

import re

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from dew import MeshSpec, Trainer
from dew.data import Dataset
from dew.nn.backbones import CausalTransformer
from dew.nn.backbones.layer_plan import LayerKind
from dew.nn.gpipe import StageSplit, staging
from dew.objectives.lm import LMObjective
from dew.training import Layout
from dew.training import mesh as mesh_lib

VOCAB = 128
BATCH = {"text": np.random.default_rng(0).integers(0, VOCAB, (8, 17)).astype(np.int32)}


def trainer(mesh, layers=4, **settings):
    model = CausalTransformer(vocab_size=VOCAB, emb_features=32, num_layers=layers, num_heads=2, mlp_features=64,
                              max_seq_len=32, scan_layers=True, **settings)
    return Trainer(LMObjective(model, seq_len=16), optax.adam(1e-2), key=jax.random.key(0), mesh=mesh,
                   layout=Layout(min_shard=1), devices=jax.devices()[: 8 if mesh.stage > 1 else 1])


class _Dense(nn.Module):
    """A model without a layer stack: next-token logits from one embedding."""

    vocab_size: int = VOCAB
    max_seq_len: int = 32

    @nn.compact
    def __call__(self, tokens):
        return nn.Embed(VOCAB, VOCAB)(tokens)


def losses(t, steps=5):
    t.fit(Dataset.from_records(BATCH, batch=8), steps=steps, log_every=1)
    return [row["loss"] for row in t.history]


def test_two_stages_of_four_microbatches_train_as_one_device():
    expected = losses(trainer(MeshSpec()))
    staged = trainer(MeshSpec(stage=2, microbatches=4))
    np.testing.assert_allclose(losses(staged), expected, rtol=1e-5)
    state = staged.init_state()
    layer_weight = state.params["layers"]["self_attn"]["q_proj"]["kernel"]
    assert layer_weight.sharding.spec[0] is None  # the stacked weights are not split over the stages


def test_stages_keep_per_layer_windows_and_packed_documents_exact():
    # Layers 0 and 2 slide a window of 3, layers 1 and 3 see everything; two documents per row.
    model = CausalTransformer(vocab_size=VOCAB, emb_features=32, num_layers=4, num_heads=2, max_seq_len=32,
                              scan_layers=True, layer_types=("sliding_attention", "full_attention") * 2,
                              kinds={"sliding_attention": LayerKind(window=3)})
    tokens = BATCH["text"][:, :16]
    segments = np.repeat(np.asarray([[0] * 9 + [1] * 7]), 8, axis=0).astype(np.int32)
    variables = model.init(jax.random.key(0), tokens)
    plain = jax.jit(lambda v: model.apply(v, tokens, segment_ids=segments))(variables)

    def staged(v):
        with staging(StageSplit(mesh=None, stages=2, microbatches=4)):
            return model.apply(v, tokens, segment_ids=segments)

    np.testing.assert_allclose(jax.jit(staged)(variables), plain, atol=1e-5)
    shuffled = jax.tree_util.tree_map(lambda w: w[::-1], variables["params"]["layers"])  # layer order matters
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(jax.jit(staged)({"params": {**variables["params"], "layers": shuffled}}),
                                   plain, atol=1e-5)


def test_stage_counts_that_do_not_cut_the_layers_are_refused():
    with pytest.raises(ValueError, match=r"MeshSpec\(stage=8\) cuts the layer stack into 8 stages .* 4 layers"):
        trainer(MeshSpec(stage=8)).lower(BATCH)
    with pytest.raises(ValueError, match="batch has 8 rows; use a batch that is a multiple of 3"):
        trainer(MeshSpec(stage=2, microbatches=3)).lower(BATCH)
    with pytest.raises(ValueError, match="scan_layers=True"):
        Trainer(LMObjective(CausalTransformer(vocab_size=VOCAB, emb_features=32, num_layers=2, num_heads=2,
                                              max_seq_len=32), seq_len=16),
                optax.adam(1e-2), key=jax.random.key(0), mesh=MeshSpec(stage=2)).lower(BATCH)
    dense = Trainer(LMObjective(_Dense(), seq_len=16), optax.adam(1e-2), key=jax.random.key(0), mesh=MeshSpec(stage=2))
    with pytest.raises(ValueError, match="ran no stack as stages .* Use stage=1"):
        dense.lower(BATCH)
    with pytest.raises(ValueError, match="microbatches=4.* but stage=1"):
        MeshSpec(microbatches=4)
    with pytest.raises(ValueError, match="MeshSpec.microbatches must be a positive integer or None; got 0"):
        MeshSpec(stage=2, microbatches=0)


def test_stages_save_activation_memory_not_parameter_memory():
    from dew.training.plan import decoder, plan

    model = decoder(dict(vocab_size=VOCAB, emb_features=64, num_layers=4, num_heads=2, mlp_features=128,
                         max_seq_len=128), seq_len=128, dtype=np.float32, remat=None)
    one = plan(model, MeshSpec(), devices=1, batch=8, seq_len=128)
    two = plan(model, MeshSpec(stage=2, microbatches=4), devices=2, batch=8, seq_len=128)
    assert two.parameters == one.parameters and two.optimizer_state == one.optimizer_state  # replicated
    assert two.activations < 0.8 * one.activations  # each device keeps its own layers' activations
    assert two.collectives["collective-permute"].count > 0  # each tick hands a stage's output to the next
    assert one.collectives["collective-permute"].count == 0


# sizes chosen so no activation shape coincides with a weight's: 8 rows of 32 positions, width 48, 96 tokens
ROWS, LENGTH, WIDTH, TOKENS = 8, 32, 48, 96


def compiled_stage_step(mesh):
    model = CausalTransformer(vocab_size=TOKENS, emb_features=WIDTH, num_layers=4, num_heads=4, mlp_features=80,
                              max_seq_len=64, scan_layers=True, remat="full")
    t = Trainer(LMObjective(model, seq_len=LENGTH), optax.adam(1e-3), key=jax.random.key(0), mesh=mesh,
                layout=Layout(min_shard=1))
    shape = (ROWS, LENGTH + 1)
    shapes = {"text": jax.ShapeDtypeStruct(shape, np.int32, sharding=t._batch_sharding(shape))}
    return t.compiled_step().lower(t._abstract_with_shardings(), shapes).compile().as_text()


def unsplit_rows(hlo, rows):
    """Activation shapes in `hlo` holding any of `rows` token rows at the model's width: ``[..., rows, L, W]``
    or flattened ``[rows * L, W]``."""
    shapes = set(re.findall(r"f32\[[0-9,]+\]", hlo))
    whole = {f"[{r},{LENGTH},{WIDTH}]" for r in rows} | {f"[{r * LENGTH},{WIDTH}]" for r in rows}
    return {s for s in shapes if any(s.endswith(w) or s.endswith(w.replace("[", ",")) for w in whole)}


def test_stage_steps_keep_each_microbatchs_rows_split_over_the_batch_axes(monkeypatch):
    # stage=2 x fsdp=4, 2 microbatches of 4 rows: each device holds 2 of the batch's rows, 1 of a microbatch's.
    mesh = MeshSpec(stage=2, fsdp=4, microbatches=2)
    whole = (ROWS, ROWS // 2)  # the batch's rows, a microbatch's rows
    assert not unsplit_rows(compiled_stage_step(mesh), whole)
    # negative control: without the row pins the pipeline's microbatches are whole on every device
    monkeypatch.setattr(mesh_lib, "sequence_split", lambda mesh, layout: None)
    assert unsplit_rows(compiled_stage_step(mesh), whole)
