"""DiffusionObjective and TextToImage: the loss, condition dropout, sampling, and bad input."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Dataset, Field, InputSpec, Trainer
from dew.diffusion.presets import EDM, Flow
from dew.objectives.base import Step
from dew.objectives.diffusion import DiffusionObjective
from dew.sampling import CFG, Euler, Heun


class TinyDenoiser(nn.Module):
    """A small conv net on the backbone call convention, with an optional label embedding."""

    num_classes: int | None = None

    @nn.compact
    def __call__(self, x, noise, conditions=None):
        conditions = conditions or {}
        unknown = set(conditions) - ({"label"} if self.num_classes else set())
        if unknown:
            raise ValueError(f"unknown condition {sorted(unknown)}")
        h = nn.Conv(16, (3, 3))(x)
        context = nn.Dense(16)(jnp.stack([jnp.sin(noise), jnp.cos(noise), noise], -1))
        if self.num_classes:
            label = conditions.get("label", jnp.full(x.shape[:1], -1))
            label = jnp.where((label < 0) | (label >= self.num_classes), self.num_classes, label)
            context = context + nn.Embed(self.num_classes + 1, 16)(label)
        h = nn.silu(h + context[:, None, None, :])
        return nn.Conv(x.shape[-1], (3, 3))(h)


def image_batch(rows=8, seed=0):
    rng = np.random.default_rng(seed)
    return {"image": rng.integers(0, 256, (rows, 8, 8, 1), dtype=np.uint8),
            "label": rng.integers(0, 3, rows).astype(np.int32)}


def objective(conditional=False, **kw):
    conditions = {"label": Field("label", ())} if conditional else None
    return DiffusionObjective(TinyDenoiser(3 if conditional else None), kw.pop("process", EDM()),
                              InputSpec(Field("image", (8, 8, 1)), conditions=conditions), **kw)


def test_the_loss_is_the_weighted_error_against_the_process_target():
    obj = objective()
    variables = obj.init(jax.random.key(0))
    batch = image_batch()
    key = jax.random.key(3)
    loss, aux = obj.loss(variables, batch, Step(jnp.int32(0), key))
    noise_key, _ = jax.random.split(key)
    x0 = batch["image"].astype(np.float32) / 127.5 - 1
    example = obj.process.training_example(noise_key, jnp.asarray(x0))
    x_in, noise_input = obj.process.model_input(example.x_t, example.t)
    out = obj.model.apply(variables, x_in, noise_input, None)
    per_example = np.mean(np.reshape((np.asarray(out) - np.asarray(example.target)) ** 2, (8, -1)), axis=1)
    assert float(loss) == pytest.approx(float(np.mean(np.asarray(example.weight) * per_example)), rel=1e-5)
    assert float(aux.metrics["mse"]) == pytest.approx(float(per_example.mean()), rel=1e-5)
    assert float(np.abs(x0).max()) <= 1.0


def test_conditions_are_dropped_per_row_with_the_unconditional_probability():
    batch = {k: jnp.asarray(v) for k, v in image_batch(rows=4000).items()}
    dropped = objective(conditional=True, unconditional_prob=0.25).conditions_of(batch, jax.random.key(0))
    fraction = float(np.mean(np.asarray(dropped["label"]) == -1))
    assert 0.22 < fraction < 0.28
    kept = np.asarray(dropped["label"]) != -1
    np.testing.assert_array_equal(np.asarray(dropped["label"])[kept], np.asarray(batch["label"])[kept])
    never = objective(conditional=True, unconditional_prob=0.0).conditions_of(batch, jax.random.key(0))
    np.testing.assert_array_equal(never["label"], batch["label"])
    assert objective().conditions_of(batch, jax.random.key(0)) is None


@pytest.mark.parametrize("preset", [EDM(), Flow()])
def test_training_lowers_the_loss_and_the_task_draws_images(preset):
    obj = objective(process=preset, ema_decay=0.9)
    batch = image_batch(rows=16)
    batch["image"][:] = 200  # a constant image: easy to learn
    data = Dataset.from_records({"image": batch["image"]}, batch=16)
    trainer = Trainer(obj, optax.adam(3e-3), key=jax.random.key(0))
    state = trainer.fit(data, steps=60, log_every=60)
    first = np.mean([h["loss"] for h in trainer.history[:10]])
    last = np.mean([h["loss"] for h in trainer.history[-10:]])
    assert last < first
    images = obj.pipeline(state)(["a", "b"], steps=10, solver=Euler(), seed=1).host()
    assert images.images.shape == (2, 8, 8, 1) and np.abs(images.images).max() <= 1.0
    assert images.uint8().dtype == np.uint8


def test_guidance_needs_conditions_and_labels_reach_the_model():
    uncond = objective()
    task = uncond.task(uncond.init(jax.random.key(0)))
    with pytest.raises(ValueError, match="Guidance needs a model trained with conditions"):
        task([None, None], steps=4, guidance=CFG(2.0), seed=0)
    cond = objective(conditional=True)
    variables = cond.init(jax.random.key(0))
    leaves, tree = jax.tree_util.tree_flatten(variables)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    variables = jax.tree_util.tree_unflatten(  # make the label embedding matter
        tree, [v + 0.05 * jax.random.normal(k, v.shape) for v, k in zip(leaves, keys)])
    task = cond.task(variables)
    a = task([0, 1], steps=4, solver=Heun(), seed=0).host().images
    b = task([0, 0], steps=4, solver=Heun(), seed=0).host().images
    np.testing.assert_allclose(a[0], b[0], atol=1e-6)
    assert not np.allclose(a[1], b[1])
    guided = task([0, 1], steps=4, solver=Heun(), seed=0, guidance=CFG(1.0)).host().images
    np.testing.assert_allclose(guided, a, atol=1e-4)  # scale 1 is the conditional model (up to rounding)
    with pytest.raises(ValueError, match="conditioned on class labels"):
        task(["a flower"], steps=4, seed=0)
    with pytest.raises(ValueError, match="exactly one of seed"):
        task([0], steps=4)


def test_images_of_the_wrong_shape_or_dtype_fail_naming_the_field():
    obj = objective()
    trainer = Trainer(obj, optax.adam(1e-3), key=jax.random.key(0))
    wrong_shape = Dataset.from_records({"image": np.zeros((8, 16, 16, 1), np.uint8)}, batch=8)
    with pytest.raises(ValueError, match=r"'image' has shape \(8, 16, 16, 1\).*\('batch', 8, 8, 1\)"):
        trainer.fit(wrong_shape, steps=1)
    wrong_dtype = Dataset.from_records({"image": np.zeros((8, 8, 8, 1), np.int64)}, batch=8)
    with pytest.raises(ValueError, match="'image' has dtype int64"):
        trainer.fit(wrong_dtype, steps=1)


def test_evaluation_draws_samples_for_fid_over_the_validation_pass():
    from dew.eval.image_metrics import FID, RandomConvFeatures

    obj = objective(evaluation_steps=4)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (40, 8, 8, 1), dtype=np.uint8)
    data = Dataset.from_records({"image": images[:24]}, batch=8, validation={"image": images[24:]})
    trainer = Trainer(obj, optax.adam(1e-3), key=jax.random.key(0))
    trainer.fit(data, steps=2, log_every=2, eval_every=2, metrics=(FID(RandomConvFeatures(dim=8)),))
    scores = trainer.evaluations[-1].scores
    assert np.isfinite(scores["val/fid"]) and scores["val/fid"] > 0 and "val/loss" in scores


def test_a_video_dit_trains_on_clips():
    from dew.diffusion.presets import Flow
    from dew.nn.backbones import VideoDiT

    model = VideoDiT(patch_size=4, tubelet_size=2, emb_features=32, num_layers=1, num_heads=2)
    obj = DiffusionObjective(model, Flow(), InputSpec(Field("video", (4, 8, 8, 3))), ema_decay=None)
    clips = np.random.default_rng(0).integers(0, 256, (8, 4, 8, 8, 3), dtype=np.uint8)
    trainer = Trainer(obj, optax.adam(1e-3), key=jax.random.key(0))
    state = trainer.fit(Dataset.from_records({"video": clips}, batch=8), steps=3, log_every=3)
    assert all(np.isfinite(h["loss"]) for h in trainer.history)
    drawn = obj.pipeline(state, ema=False)([None, None], steps=3, solver=Euler(), seed=0).host()
    assert drawn.images.shape == (2, 4, 8, 8, 3)


class PoolingAutoencoder:
    """A fixed autoencoder: 2x2 average pooling to latents, nearest upsampling back."""

    def encode(self, images):
        b, h, w, c = images.shape
        return images.reshape(b, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4)) * 2.0

    def decode(self, latents):
        return jnp.repeat(jnp.repeat(latents / 2.0, 2, axis=1), 2, axis=2)

    def latent_shape(self, sample_shape):
        h, w, c = sample_shape
        return (h // 2, w // 2, c)


def test_latent_diffusion_trains_and_samples_through_the_autoencoder_interface():
    obj = DiffusionObjective(TinyDenoiser(), EDM(regime="latent"), InputSpec(Field("image", (8, 8, 1))),
                             autoencoder=PoolingAutoencoder(), ema_decay=None)
    assert obj.model_shape == (4, 4, 1)
    variables = obj.init(jax.random.key(0))
    assert variables["params"]["Conv_0"]["kernel"].shape[-2] == 1
    data = Dataset.from_records({"image": image_batch(rows=16)["image"]}, batch=16)
    trainer = Trainer(obj, optax.adam(1e-3), key=jax.random.key(0))
    state = trainer.fit(data, steps=2, log_every=2)
    drawn = obj.pipeline(state, ema=False)([None, None], steps=3, solver=Euler(), seed=0).host()
    assert drawn.images.shape == (2, 8, 8, 1)  # decoded back to pixels
    # every 2x2 block of a decoded sample is constant: it went through the decoder
    np.testing.assert_array_equal(drawn.images[:, ::2, ::2], drawn.images[:, 1::2, 1::2])
