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
    np.testing.assert_allclose(everything_dropped["text"], empty.last, atol=1e-6, rtol=0)
    np.testing.assert_allclose(everything_dropped["embedding"], empty.pooled, atol=1e-6, rtol=0)
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
