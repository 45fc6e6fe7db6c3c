"""VAEObjective: a small AutoencoderKL learns to reconstruct images, and then encodes for latent diffusion."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Dataset, Field, InputSpec, Trainer
from dew.diffusion.presets import Flow
from dew.eval.image_metrics import PSNR
from dew.nn.backbones.dit import SimpleDiT
from dew.nn.vae import AutoencoderKL
from dew.objectives.base import Step
from dew.objectives.diffusion import DiffusionObjective
from dew.objectives.vae import VAEObjective

MODEL = AutoencoderKL(block_out_channels=(8, 8), layers_per_block=1, norm_num_groups=4, latent_channels=4)
SMALL = MODEL.clone(block_out_channels=(8,))  # one level: no downsampling, the cheapest to compile
INPUTS = InputSpec(Field("image", (8, 8, 3)))


def smooth_images(rows, seed=0):
    """Gradients of random colour: images a tiny VAE can learn to reconstruct."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0.0, 1.0, 8)[None, :, None, None] * np.linspace(0.0, 1.0, 8)[None, None, :, None]
    colours = rng.uniform(0, 1, (rows, 1, 1, 3))
    return np.round(255 * (0.2 + 0.6 * colours * ramp + 0.2 * (1 - ramp))).astype(np.uint8)


def test_training_lowers_the_reconstruction_error_and_the_result_encodes():
    objective = VAEObjective(SMALL, INPUTS, kl_weight=1e-4)
    data = Dataset.from_records({"image": smooth_images(16)}, batch=8)
    trainer = Trainer(objective, optax.adam(3e-3), key=jax.random.key(0))
    state = trainer.fit(data, steps=30, log_every=30)
    first = np.mean([h["l1"] for h in trainer.history[:3]])
    last = np.mean([h["l1"] for h in trainer.history[-3:]])
    assert last < 0.5 * first

    vae = objective.autoencoder(state.variables)
    latent = DiffusionObjective(SimpleDiT(patch_size=2, emb_features=16, num_layers=1, num_heads=2), Flow(),
                                INPUTS, autoencoder=vae)
    assert latent.model_shape == (8, 8, 4)
    assert vae.encode(jnp.zeros((1, 8, 8, 3))).shape == (1, 8, 8, 4)


def test_the_kl_term_is_the_divergence_from_the_unit_gaussian():
    """With quant_conv set to output a constant mean m and log-variance l, the KL per example is
    n / 2 (m^2 + e^l - 1 - l) over its n latent values, the closed form for two Gaussians."""
    model = SMALL
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8, 8, 3)))
    variables = jax.tree.map(lambda leaf: jnp.full(leaf.shape, 0.01, leaf.dtype), flax.core.meta.unbox(abstract))
    m, l = 0.7, -0.4
    variables["params"]["quant_conv"] = {"kernel": jnp.zeros((1, 1, 8, 8)),
                                         "bias": jnp.asarray([m] * 4 + [l] * 4, jnp.float32)}
    objective = VAEObjective(model, INPUTS, kl_weight=0.5)
    outputs = jax.jit(objective.evaluate)(variables, {"image": smooth_images(2)}, Step(jnp.int32(0), jax.random.key(0)))
    metric = PSNR()  # reconstructions and images are the outputs image metrics read
    assert np.isfinite(metric.result(metric.update(metric.empty(), jax.device_get(outputs)))["psnr"])
    n = 8 * 8 * 4
    expected = n / 2 * (m**2 + np.exp(l) - 1 - l)
    assert float(outputs["kl"]) == pytest.approx(expected, rel=1e-5)
    assert float(outputs["loss"]) == pytest.approx(float(outputs["l1"]) * 8 * 8 * 3 + 0.5 * expected, rel=1e-5)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="multiples of 2"):
        VAEObjective(MODEL, InputSpec(Field("image", (9, 8, 3))))
    with pytest.raises(TypeError, match="trains an AutoencoderKL"):
        VAEObjective(SimpleDiT(patch_size=2, emb_features=16, num_layers=1, num_heads=2), INPUTS)
    with pytest.raises(ValueError, match="kl_weight"):
        VAEObjective(MODEL, INPUTS, kl_weight=-1.0)
