"""TextCondition: captions encoded inside the diffusion step by a frozen CLIP / T5 encoder."""

from __future__ import annotations

import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.diffusion.presets import Flow
from dew.interop.text_encoders import PretrainedTextEncoder
from dew.nn.backbones.mmdit import MMDiT
from dew.objectives.base import Field, InputSpec, Step
from dew.objectives.diffusion import DiffusionObjective
from dew.objectives.text_condition import TextCondition

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "text_encoders"
TOLERANCE = 1e-4
CAPTIONS = ["a handwritten seven", "The digit 7, drawn in ink!"]  # the fixtures' first two captions


@pytest.fixture(scope="module")
def encoders():
    return {name: PretrainedTextEncoder.load(FIXTURES / name) for name in ("clip", "t5")}


def objective(condition, prob=0.1):
    model = MMDiT(patch_size=2, emb_features=32, num_layers=1, num_heads=2, text_features=32,
                  condition_features=24 if condition.pooled == "projected" else None)
    inputs = InputSpec(Field("image", (8, 8, 3)), conditions={"caption": condition})
    return DiffusionObjective(model, Flow(), inputs, unconditional_prob=prob)


def batch_of(condition, captions=CAPTIONS):
    images = np.random.default_rng(0).integers(0, 256, (len(captions), 8, 8, 3), dtype=np.uint8)
    return {"image": images, "caption": condition.tokenize(captions)}


def test_the_step_sees_the_encoders_outputs(encoders):
    """Through the condition, the backbone reads transformers' penultimate states and projection."""
    ref = np.load(FIXTURES / "clip" / "reference.npz")
    condition = TextCondition(encoders["clip"], layer="penultimate", pooled="projected")
    conditions = objective(condition).conditions_of(batch_of(condition))
    np.testing.assert_allclose(conditions["text"], ref["penultimate"][:2], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(conditions["embedding"], ref["projected"][:2], atol=TOLERANCE, rtol=0)
    last = TextCondition(encoders["clip"]).encode(jnp.asarray(batch_of(condition)["caption"]))
    np.testing.assert_allclose(last["text"], ref["last"][:2], atol=TOLERANCE, rtol=0)
    assert np.abs(np.asarray(last["text"]) - ref["penultimate"][:2]).max() > 100 * TOLERANCE  # the layers differ


def test_t5_captions_with_their_mask(encoders):
    ref = np.load(FIXTURES / "t5" / "reference.npz")
    condition = TextCondition(encoders["t5"], mask=True)
    out = condition.encode(jnp.asarray(condition.tokenize(CAPTIONS)))
    np.testing.assert_allclose(out["text"], ref["masked_last"][:2], atol=TOLERANCE, rtol=0)
    np.testing.assert_array_equal(out["text_mask"], ref["attention_mask"][:2].astype(bool))


def test_dropped_rows_read_the_empty_caption(encoders):
    condition = TextCondition(encoders["clip"], pooled="pooled")
    everything_dropped = objective(condition, prob=1.0).conditions_of(batch_of(condition), jax.random.key(0))
    empty = encoders["clip"](["", ""])
    # the same encoder compiled inside the step and alone: equal up to float32 rounding (a few ulps)
    np.testing.assert_allclose(everything_dropped["text"], empty.last, atol=1e-5, rtol=0)
    np.testing.assert_allclose(everything_dropped["embedding"], empty.pooled, atol=1e-5, rtol=0)
    kept = objective(condition, prob=0.0).conditions_of(batch_of(condition), jax.random.key(0))
    assert np.abs(np.asarray(kept["text"]) - np.asarray(empty.last)).max() > 1e-2  # a real caption is not the empty one


def test_the_loss_trains_the_backbone_and_not_the_encoder(encoders):
    condition = TextCondition(encoders["clip"], pooled="projected")
    diffusion = objective(condition)
    variables = jax.jit(diffusion.init)(jax.random.key(0))
    backbone_only = jax.eval_shape(diffusion.model.init, jax.random.key(0), jnp.zeros((1, 8, 8, 3)), jnp.zeros((1,)),
                                   {"text": jnp.zeros((1, 16, 32)), "embedding": jnp.zeros((1, 24))})
    assert set(variables["params"]) == set(backbone_only["params"])  # the encoder's weights are not trained
    batch = {name: jnp.asarray(value) for name, value in batch_of(condition).items()}
    diffusion.check(batch)

    @jax.jit
    def loss_and_grad(variables):
        return jax.value_and_grad(lambda v: diffusion.loss(v, batch, Step(jnp.int32(0), jax.random.key(1)))[0])(variables)

    loss, grads = loss_and_grad(variables)
    assert np.isfinite(float(loss))
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def test_prompts_draw_through_the_task(encoders):
    condition = TextCondition(encoders["clip"])
    diffusion = objective(condition)
    task = diffusion.task(jax.jit(diffusion.init)(jax.random.key(0)))
    images = task(["a handwritten seven", None], steps=2, guidance=2.0, key=jax.random.key(3))
    assert images.images.shape == (2, 8, 8, 3)
    with pytest.raises(ValueError, match="conditioned on captions"):
        task([7], steps=2, key=jax.random.key(3))


def test_bad_captions_fail_before_compiling(encoders):
    condition = TextCondition(encoders["clip"])
    diffusion = objective(condition)
    batch = batch_of(condition)
    with pytest.raises(ValueError, match="no caption column 'caption'"):
        diffusion.check({"image": batch["image"]})
    with pytest.raises(ValueError, match="holds strings"):
        diffusion.check({**batch, "caption": np.asarray(CAPTIONS)})
    with pytest.raises(ValueError, match=r"expects \('batch', 16\)"):
        diffusion.check({**batch, "caption": batch["caption"][:, :8]})
    strict = TextCondition(encoders["clip"], max_length=4, truncate=False)
    with pytest.raises(ValueError, match="max_length=4"):
        strict.tokenize(CAPTIONS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="cut to fit"):
            TextCondition(encoders["clip"], max_length=4).tokenize(CAPTIONS)
    with pytest.raises(ValueError, match="need a CLIP encoder"):
        TextCondition(encoders["t5"], layer="penultimate")
    with pytest.raises(ValueError, match="layer must be one of"):
        TextCondition(encoders["clip"], layer="first")


def test_the_encoders_weights_ride_in_the_state_not_in_the_compiled_step(encoders):
    """A frozen collection: sharded and passed like weights, no optimizer state, not checkpointed, and
    no longer a constant of the step; the conditions and the loss are those of the baked encoder."""
    import re

    import optax
    from flax.core import meta

    from dew.training.trainer import Trainer

    encoder = encoders["clip"]
    condition = TextCondition(encoder, layer="penultimate", pooled="projected")
    diffusion = objective(condition)
    trainer = Trainer(diffusion, optax.adam(1e-3), key=jax.random.key(0))
    state = trainer._abstract_with_shardings()  # shapes and shardings: lowering the step needs no values
    assert diffusion.frozen_collections == ("caption_encoder",)
    table = encoder.variables["params"]["token_embedding"]["embedding"]
    assert state.variables["caption_encoder"]["params"]["token_embedding"]["embedding"].shape == table.shape
    assert set(trainer._saved(state).variables) == {"params"}  # checkpoints leave the encoder out
    opt_shapes = {leaf.shape for leaf in jax.tree.leaves(state.opt_state)}
    assert table.shape not in opt_shapes  # no optimizer state for it

    batch = trainer.place(batch_of(condition, CAPTIONS * 4))
    step = Step(jnp.int32(0), jax.random.key(1))
    table_constant = re.compile(r"constant dense<[^>]*> : tensor<%dx%dxf32>" % table.shape)
    compiled_step = trainer.compiled_step().lower(state, batch).as_text()
    assert not table_constant.search(compiled_step)
    baked = {"params": state.variables["params"]}  # without the collection: the encoder's own weights, as constants
    baked_loss = jax.jit(lambda v, b: diffusion.loss(v, b, step)[0]).lower(baked, batch)
    assert table_constant.search(baked_loss.as_text())  # negative control: the old way holds the table

    ref = np.load(FIXTURES / "clip" / "reference.npz")
    held = meta.unbox(condition.frozen_variables())  # what init places in the collection
    np.testing.assert_array_equal(held["params"]["token_embedding"]["embedding"], table)
    conditions_of = jax.jit(lambda variables: diffusion.conditions_of(batch_of(condition), variables=variables))
    conditions = conditions_of({"caption_encoder": held})
    np.testing.assert_allclose(conditions["text"], ref["penultimate"][:2], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(conditions["embedding"], ref["projected"][:2], atol=TOLERANCE, rtol=0)
    moved = conditions_of({"caption_encoder": jax.tree.map(lambda w: 2 * w, held)})  # the step reads the collection
    assert np.abs(np.asarray(moved["text"]) - ref["penultimate"][:2]).max() > 100 * TOLERANCE


@pytest.mark.slow
def test_checkpoints_leave_the_encoder_out_and_a_resumed_run_takes_it_again(encoders, tmp_path):
    import optax

    from dew.data.dataset import Dataset
    from dew.training.checkpoints import Checkpoints
    from dew.training.trainer import Trainer

    condition = TextCondition(encoders["clip"])
    data = Dataset.from_records(batch_of(condition, CAPTIONS * 4), batch=8)
    trainer = Trainer(objective(condition), optax.adam(1e-3), key=jax.random.key(0),
                      checkpoints=Checkpoints(tmp_path))
    trainer.fit(data, steps=1, log_every=1, checkpoint_every=1)
    saved, _, _ = Checkpoints(tmp_path).restore_variables()
    assert sorted(saved) == ["params"]  # the encoder's weights are not in the checkpoint
    resumed = Trainer(objective(condition), optax.adam(1e-3), key=jax.random.key(0), checkpoints=Checkpoints(tmp_path))
    state, _, step = resumed.restore_or_init()
    assert step == 1
    table = encoders["clip"].variables["params"]["token_embedding"]["embedding"]
    np.testing.assert_array_equal(state.variables["caption_encoder"]["params"]["token_embedding"]["embedding"], table)
