"""AutoencoderKL against diffusers: fixtures written by tools/vae_fixtures.py (tiny SD- and Flux-style VAEs)."""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop.autoencoders import PretrainedAutoencoder
from dew.nn.vae import AutoencoderKL

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "vae"
TOLERANCE = 1e-4


def reference(name):
    return np.load(FIXTURES / name / "reference.npz")


@pytest.fixture(scope="module")
def loaded():
    return {name: PretrainedAutoencoder.load(FIXTURES / name) for name in ("sd", "flux")}


@pytest.mark.parametrize("name", ["sd", "flux"])
def test_encode_and_decode_match_diffusers(loaded, name):
    vae, ref = loaded[name], reference(name)
    mean, logvar = vae.model.apply(vae.variables, jnp.asarray(ref["images"]), method=AutoencoderKL.posterior)
    np.testing.assert_allclose(mean, ref["mean"], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(logvar, ref["logvar"], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(vae.encode(jnp.asarray(ref["images"])), ref["latents"], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(vae.decode(jnp.asarray(ref["latents"])), ref["decoded"], atol=TOLERANCE, rtol=0)


def test_config_settings_are_read(loaded):
    flux = loaded["flux"].model
    assert (flux.latent_channels, flux.use_quant_conv, flux.scaling_factor, flux.shift_factor) == (16, False, 0.3611, 0.1159)
    assert loaded["sd"].latent_shape((16, 16, 3)) == (4, 4, 4)
    assert loaded["flux"].latent_shape((16, 16, 3)) == (8, 8, 16)


@pytest.mark.parametrize("change", ["group_count", "scaling_factor", "shift_factor"])
def test_a_wrong_setting_breaks_parity(loaded, change):
    """Negative control: each setting the parity test relies on changes the outputs beyond tolerance."""
    name = "flux" if change == "shift_factor" else "sd"
    vae, ref = loaded[name], reference(name)
    wrong = {"group_count": dict(norm_num_groups=2), "scaling_factor": dict(scaling_factor=1.0),
             "shift_factor": dict(shift_factor=0.0)}[change]
    model = vae.model.clone(**wrong)
    latents = model.apply(vae.variables, jnp.asarray(ref["images"]), method=AutoencoderKL.encode)
    assert np.abs(np.asarray(latents) - ref["latents"]).max() > 100 * TOLERANCE


def test_a_posterior_draw_uses_the_key(loaded):
    vae, ref = loaded["sd"], reference("sd")
    images = jnp.asarray(ref["images"])
    first, again = vae.encode(images, jax.random.key(1)), vae.encode(images, jax.random.key(1))
    other = vae.encode(images, jax.random.key(2))
    np.testing.assert_array_equal(first, again)
    assert np.abs(np.asarray(first) - np.asarray(other)).max() > 1e-3
    # the draw is mean + std * noise: standardized, it has about unit spread around the mean
    std = np.exp(0.5 * ref["logvar"]) * vae.model.scaling_factor
    noise = (np.asarray(first) - ref["latents"]) / std
    assert 0.7 < noise.std() < 1.3 and abs(noise.mean()) < 0.3


def test_save_then_load_gives_the_same_outputs(loaded, tmp_path):
    vae, ref = loaded["flux"], reference("flux")
    vae.save(tmp_path / "vae")
    assert sorted(p.name for p in (tmp_path / "vae").iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    again = PretrainedAutoencoder.load(tmp_path / "vae")
    assert again.model == vae.model
    images = jnp.asarray(ref["images"])
    np.testing.assert_array_equal(again.encode(images), vae.encode(images))
    np.testing.assert_array_equal(again.decode(jnp.asarray(ref["latents"])), vae.decode(jnp.asarray(ref["latents"])))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        vae.save(tmp_path / "vae")


def random_variables(model, shape, seed=0):
    """Variables of the model's own structure drawn with NumPy (cheaper than compiling its init)."""
    from flax.core import meta

    abstract = meta.unbox(jax.eval_shape(model.init, jax.random.key(0), jnp.zeros(shape)))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda leaf: jnp.asarray(0.2 * rng.standard_normal(leaf.shape), leaf.dtype), abstract)


def test_a_model_made_in_dew_saves_for_diffusers(tmp_path):
    model = AutoencoderKL(block_out_channels=(8, 8), layers_per_block=1, norm_num_groups=4, latent_channels=4)
    bundle = PretrainedAutoencoder.from_model(model, random_variables(model, (1, 8, 8, 3)))
    bundle.save(tmp_path / "mine")
    config = json.loads((tmp_path / "mine" / "config.json").read_text())
    assert config["_class_name"] == "AutoencoderKL" and config["layers_per_block"] == 1
    again = PretrainedAutoencoder.load(tmp_path / "mine")
    images = jax.random.uniform(jax.random.key(1), (2, 8, 8, 3), minval=-1, maxval=1)
    np.testing.assert_array_equal(again.encode(images), bundle.encode(images))
    with pytest.raises(ValueError, match="missing params"):
        PretrainedAutoencoder.from_model(model.clone(layers_per_block=2), bundle.variables).save(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_calling_the_model_reconstructs_through_a_posterior_draw(loaded):
    vae, ref = loaded["sd"], reference("sd")
    images = jnp.asarray(ref["images"])
    reconstruction, mean, logvar = vae.model.apply(vae.variables, images, None)
    np.testing.assert_allclose(reconstruction, ref["decoded"], atol=TOLERANCE, rtol=0)  # the mean's decoding
    drawn, _, _ = vae.model.apply(vae.variables, images, jax.random.key(2))
    assert drawn.shape == images.shape and np.abs(np.asarray(drawn) - ref["decoded"]).max() > 1e-3


def test_latent_diffusion_trains_through_the_autoencoder(loaded):
    from dew.diffusion.presets import Flow
    from dew.nn.backbones.dit import SimpleDiT
    from dew.objectives.base import Field, InputSpec, Step
    from dew.objectives.diffusion import DiffusionObjective

    vae = loaded["sd"]
    diffusion = DiffusionObjective(SimpleDiT(patch_size=2, emb_features=32, num_layers=1, num_heads=2), Flow(),
                                   InputSpec(Field("image", (16, 16, 3))), autoencoder=vae)
    assert diffusion.model_shape == (4, 4, 4)
    variables = jax.jit(diffusion.init)(jax.random.key(0))
    images = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    loss, _ = jax.jit(diffusion.loss)(variables, {"image": images}, Step(jnp.int32(0), jax.random.key(1)))
    assert np.isfinite(float(loss))
    assert diffusion.task(variables).autoencoder is vae  # the task decodes its latents with the VAE


def test_bad_input_is_refused_with_the_fix(loaded, tmp_path):
    vae = loaded["sd"]
    with pytest.raises(ValueError, match="multiples of 4"):
        vae.latent_shape((18, 16, 3))
    with pytest.raises(ValueError, match=r"latents \[batch, height, width, 4\]"):
        vae.decode(jnp.zeros((1, 4, 4, 16)))
    with pytest.raises(ValueError, match="not a multiple of norm_num_groups"):
        AutoencoderKL(block_out_channels=(8, 12), norm_num_groups=8).init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))

    # an encoder directory of another kind, and weights that do not fit the config
    other = tmp_path / "unet"
    shutil.copytree(FIXTURES / "sd", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "_class_name": "UNet2DConditionModel"}))
    with pytest.raises(ValueError, match="not an AutoencoderKL"):
        PretrainedAutoencoder.load(other)
    (other / "config.json").write_text(json.dumps({**config, "layers_per_block": 1}))
    with pytest.raises(ValueError, match="unexpected tensors"):
        PretrainedAutoencoder.load(other)
    (other / "config.json").write_text(json.dumps({**config, "latent_channels": 8}))
    with pytest.raises(ValueError, match=r"'decoder.conv_in.weight' .* has shape \[16, 4, 3, 3\], but config.json implies \[16, 8, 3, 3\]"):
        PretrainedAutoencoder.load(other)
    (other / "config.json").write_text(json.dumps({**config, "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4}))
    with pytest.raises(ValueError, match="latents_mean"):
        PretrainedAutoencoder.load(other)
    with pytest.raises(FileNotFoundError, match="vae/ folder"):
        PretrainedAutoencoder.load(tmp_path)


@pytest.mark.reference
def test_diffusers_reads_what_dew_saves(loaded, tmp_path):
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    vae, ref = loaded["sd"], reference("sd")
    vae.save(tmp_path / "vae")
    theirs = diffusers.AutoencoderKL.from_pretrained(tmp_path / "vae").eval()
    images = torch.from_numpy(ref["images"].transpose(0, 3, 1, 2).copy())
    with torch.no_grad():
        mean = theirs.encode(images).latent_dist.mean.numpy().transpose(0, 2, 3, 1)
        decoded = theirs.decode(torch.from_numpy(ref["latents"].transpose(0, 3, 1, 2).copy()) / 0.18215).sample
    np.testing.assert_allclose(mean, ref["mean"], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(decoded.numpy().transpose(0, 2, 3, 1), ref["decoded"], atol=TOLERANCE, rtol=0)
