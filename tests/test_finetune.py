"""Fine-tuning a published denoiser with its source's own training recipe (`DiffusionObjective.
from_pipeline`, `SourceProcess`'s training side), on the tiny pipelines of
tools/diffusion_pipeline_fixtures.py. The expected values are diffusers' training formulas written
out in NumPy here: DDPMScheduler's betas, add_noise and get_velocity (train_text_to_image.py), and
FlowMatchEulerDiscreteScheduler's training table (train_dreambooth_sd3.py / _flux.py)."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from dew.data.dataset import Dataset
from dew.interop.diffusion_pipelines import DiffusionPipeline
from dew.interop.schedulers import SourceScheduler
from dew.interop.unet_condition import PretrainedUNet
from dew.nn.adapters import LoRA
from dew.objectives.base import Step
from dew.objectives.diffusion import DiffusionObjective
from dew.pixels import to_unit_range
from dew.training.trainer import Trainer

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "pipelines"
CAPTIONS = ["a red square", "a blue circle", "a green stripe", "a white dot"]
SIZE = 16  # pixels: the fixtures' VAEs halve it to 8x8 latents
SD_DISCRETE = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}


@pytest.fixture(scope="module")
def pipelines():
    """The SD 1.5 and SD3 fixtures, with their rebuilt source schedulers."""
    return {family: DiffusionPipeline.load(FIXTURES / family) for family in ("sd15", "sd3")}


def pictures(rows=8):
    """Flat colours with a bright square: a set a few steps of training visibly fit."""
    images = np.zeros((rows, SIZE, SIZE, 3), np.uint8)
    for i in range(rows):
        images[i] = (np.array([200, 40, 90]) * (i + 1) // rows).astype(np.uint8)
        images[i, 4:10, 2 + i:8 + i] = 255
    return images


def batch_of(objective, rows=8):
    """``rows`` captioned pictures (8: one row per device of the test mesh)."""
    return {"image": pictures(rows), **objective.conditions_for((CAPTIONS * 2)[:rows])}


# --- diffusers' training formulas, in NumPy --------------------------------------------------------


def ddpm_alphas_cumprod(beta_schedule, start=0.00085, end=0.012, steps=1000):
    """DDPMScheduler.__init__: float32 betas, alphas_cumprod = cumprod(1 - betas)."""
    if beta_schedule == "scaled_linear":
        betas = np.linspace(start**0.5, end**0.5, steps, dtype=np.float32) ** 2
    else:
        betas = np.linspace(start, end, steps, dtype=np.float32)
    return np.cumprod(1.0 - betas, axis=0).astype(np.float32)


def ddpm_add_noise(alphas_cumprod, x0, noise, timesteps):
    a = (alphas_cumprod[timesteps] ** 0.5).reshape(-1, 1, 1, 1)
    s = ((1 - alphas_cumprod[timesteps]) ** 0.5).reshape(-1, 1, 1, 1)
    return a * x0 + s * noise


def ddpm_velocity(alphas_cumprod, x0, noise, timesteps):
    a = (alphas_cumprod[timesteps] ** 0.5).reshape(-1, 1, 1, 1)
    s = ((1 - alphas_cumprod[timesteps]) ** 0.5).reshape(-1, 1, 1, 1)
    return a * noise - s * x0


def flow_training_sigmas(shift, steps=1000):
    """FlowMatchEulerDiscreteScheduler.__init__ without dynamic shifting: its sigmas, descending."""
    sigmas = np.linspace(1, steps, steps, dtype=np.float32)[::-1].copy() / steps
    return (shift * sigmas / (1 + (shift - 1) * sigmas)).astype(np.float32)


def draws(key, shape):
    """The objective's draws for one step key: (uniform u, unit noise) as `SourceProcess` takes them."""
    noise_key, _ = jax.random.split(key)  # the loss splits off its condition-dropout key
    time_key, noise_key = jax.random.split(noise_key)
    u = np.asarray(jax.random.uniform(time_key, (shape[0],), minval=0.0, maxval=1.0))
    return u, np.asarray(jax.random.normal(noise_key, shape, jnp.float32))


# --- (1) the training example is the source's recipe -----------------------------------------------


def test_discrete_training_example_is_ddpm_add_noise_on_scaled_linear_betas(pipelines):
    process = DiffusionObjective.from_pipeline(pipelines["sd15"], SIZE).process
    x0 = np.asarray(jax.random.normal(jax.random.key(3), (4, 8, 8, 4)))
    key = jax.random.key(7)
    example = process.training_example(key, jnp.asarray(x0))
    time_key, noise_key = jax.random.split(key)
    timesteps = np.floor(np.asarray(jax.random.uniform(time_key, (4,))) * 1000).astype(np.int64)
    noise = np.asarray(jax.random.normal(noise_key, x0.shape))
    np.testing.assert_array_equal(np.asarray(example.t), timesteps.astype(np.float32))
    expected = ddpm_add_noise(ddpm_alphas_cumprod("scaled_linear"), x0, noise, timesteps)
    np.testing.assert_allclose(np.asarray(example.x_t), expected, atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(example.target), noise, atol=0, rtol=0)  # epsilon
    # negative control: DDPM's default linear betas put the same timesteps elsewhere
    linear = ddpm_add_noise(ddpm_alphas_cumprod("linear"), x0, noise, timesteps)
    assert np.abs(np.asarray(example.x_t) - linear).max() > 1e-2


def test_v_prediction_regresses_ddpm_get_velocity():
    scheduler = SourceScheduler.from_config({"_class_name": "EulerDiscreteScheduler", **SD_DISCRETE,
                                             "prediction_type": "v_prediction"})  # SD 2.1's settings
    process = scheduler.training_process()
    x0 = np.asarray(jax.random.normal(jax.random.key(1), (3, 4, 4, 4)))
    noise = np.asarray(jax.random.normal(jax.random.key(2), x0.shape))
    timesteps = np.array([0, 517, 999])
    example = process.add_noise(jnp.asarray(x0), jnp.asarray(noise), jnp.asarray(timesteps, jnp.float32))
    table = ddpm_alphas_cumprod("scaled_linear")
    np.testing.assert_allclose(np.asarray(example.target), ddpm_velocity(table, x0, noise, timesteps), atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(example.x_t), ddpm_add_noise(table, x0, noise, timesteps), atol=1e-6, rtol=0)
    # negative control: an epsilon target is not what a v-prediction model learns
    assert np.abs(np.asarray(example.target) - noise).max() > 1e-1
    np.testing.assert_allclose(np.asarray(scheduler.alphas_cumprod()), table, atol=0, rtol=0)


def test_unet_loss_calls_the_network_at_integer_timesteps_on_vae_latents(pipelines):
    pipeline = pipelines["sd15"]
    objective = DiffusionObjective.from_pipeline(pipeline, SIZE)
    batch = batch_of(objective)
    key = jax.random.key(11)
    loss, _ = jax.jit(objective.loss)(objective.variables, batch, Step(0, key))
    latents = np.asarray(pipeline.autoencoder.encode(to_unit_range(batch["image"])))  # scaled latents
    u, noise = draws(key, latents.shape)
    timesteps = np.floor(u * 1000).astype(np.int64)
    x_t = ddpm_add_noise(ddpm_alphas_cumprod("scaled_linear"), latents, noise, timesteps)
    conditions = {"encoder_hidden_states": batch["encoder_hidden_states"]}

    def mse(t):
        output = np.asarray(pipeline.denoiser(x_t, t, conditions))
        return np.mean((output - noise) ** 2)

    np.testing.assert_allclose(float(loss), mse(timesteps.astype(np.float32)), rtol=1e-5)
    # negative control: Dew's own [0, 1] time convention gives the network another input
    assert abs(float(loss) - mse(timesteps / 1000.0)) > 1e-3


def test_flow_training_example_uses_the_source_shift_and_timesteps_in_its_units(pipelines):
    pipeline = pipelines["sd3"]
    objective = DiffusionObjective.from_pipeline(pipeline, SIZE)
    process = objective.process
    x0 = np.asarray(jax.random.normal(jax.random.key(5), (4, 8, 8, 16)))
    key = jax.random.key(9)
    example = process.training_example(key, jnp.asarray(x0))
    time_key, noise_key = jax.random.split(key)
    index = np.floor(np.asarray(jax.random.uniform(time_key, (4,))) * 1000).astype(np.int64)
    noise = np.asarray(jax.random.normal(noise_key, x0.shape))
    sigmas = flow_training_sigmas(3.0)[index].reshape(-1, 1, 1, 1)  # the fixture's shift
    np.testing.assert_allclose(np.asarray(example.t), sigmas.ravel() * 1000, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(example.x_t), (1 - sigmas) * x0 + sigmas * noise, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(example.target), noise - x0, atol=1e-6, rtol=0)
    unshifted = flow_training_sigmas(1.0)[index].reshape(-1, 1, 1, 1)  # negative control: no shift
    assert np.abs(np.asarray(example.x_t) - ((1 - unshifted) * x0 + unshifted * noise)).max() > 1e-2
    # the network sees x_t and those timesteps (SD3Transformer2DModel takes 0..1000)
    x_in, network_t = process.model_input(example.x_t, example.t)
    np.testing.assert_array_equal(np.asarray(network_t), np.asarray(example.t))


def test_flux_trains_on_the_unshifted_table_and_passes_timesteps_over_1000():
    config = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "use_dynamic_shifting": True}
    scheduler = SourceScheduler.from_config(config, pipeline_sigmas="flux", model_timestep_scale=0.001)
    np.testing.assert_allclose(scheduler.training_sigmas(), flow_training_sigmas(1.0), atol=0, rtol=0)
    _, network_t = scheduler.training_process().model_input(jnp.zeros((2, 4, 4, 16)), jnp.asarray([1000.0, 250.0]))
    np.testing.assert_allclose(np.asarray(network_t), [1.0, 0.25], rtol=1e-7)


def test_flux_loss_calls_the_transformer_at_unshifted_levels_over_1000(pipelines):
    pipeline = DiffusionPipeline.load(FIXTURES / "flux")  # FluxPipeline passes its transformer timesteps / 1000
    assert pipeline.scheduler.model_timestep_scale == 0.001
    objective = DiffusionObjective.from_pipeline(pipeline, SIZE)
    batch = batch_of(objective, rows=2)
    key = jax.random.key(13)
    loss, _ = jax.jit(objective.loss)(objective.variables, batch, Step(0, key))
    latents = np.asarray(pipeline.autoencoder.encode(to_unit_range(batch["image"])))
    u, noise = draws(key, latents.shape)

    def mse(shift):
        sigmas = flow_training_sigmas(shift)[np.floor(u * 1000).astype(np.int64)]
        t = sigmas.reshape(-1, 1, 1, 1)
        conditions = {name: batch[name] for name in ("encoder_hidden_states", "pooled_projections", "guidance")}
        output = np.asarray(pipeline.denoiser((1 - t) * latents + t * noise, sigmas, conditions))
        return np.mean((output - (noise - latents)) ** 2)

    np.testing.assert_allclose(float(loss), mse(1.0), rtol=1e-4)  # dynamic shifting: the table is unshifted
    assert abs(float(loss) - mse(3.0)) > 1e-3 * float(loss)  # negative control: the config's static shift


def test_dropped_captions_take_the_pipelines_empty_prompt_encoding(pipelines):
    objective = DiffusionObjective.from_pipeline(pipelines["sd15"], SIZE, unconditional_prob=1.0)
    batch = batch_of(objective, rows=2)
    dropped = objective.conditions_of(batch, jax.random.key(0))
    empty = objective.conditions_for([""])["encoder_hidden_states"]
    np.testing.assert_allclose(np.asarray(dropped["encoder_hidden_states"]), np.repeat(empty, 2, axis=0), atol=1e-6)
    assert np.abs(empty).max() > 0  # SD's unconditional row is the encoded "", not zeros


def test_fine_tuning_refuses_a_scheduler_without_a_training_side(pipelines):
    class Sampler:  # a scheduler object with sampling alone
        process = None

    pipeline = pipelines["sd15"]
    stripped = DiffusionPipeline(pipeline.index, pipeline.prompts, pipeline.autoencoder, pipeline.denoiser, Sampler())
    with pytest.raises(TypeError, match="no training side"):
        DiffusionObjective.from_pipeline(stripped, SIZE)


# --- (2) a few Trainer steps lower the loss ---------------------------------------------------------


def held_out_loss(objective, variables, batch):
    """The loss averaged over fixed step keys, so two weights compare on the same noise and timesteps."""
    loss = jax.jit(objective.loss)
    return float(np.mean([loss(variables, batch, Step(0, jax.random.key(100 + i)))[0] for i in range(4)]))


def fine_tune(objective, steps, learning_rate=3e-3):
    batch = batch_of(objective)
    trainer = Trainer(objective, optax.adam(learning_rate), key=jax.random.key(0))
    state = trainer.fit(Dataset.from_records(batch, batch=8), steps=steps, log_every=steps)
    return state, batch


@pytest.fixture(scope="module")
def tuned_unet(pipelines):
    objective = DiffusionObjective.from_pipeline(pipelines["sd15"], SIZE)
    state, batch = fine_tune(objective, steps=12)
    return objective, state, batch


def test_a_few_steps_lower_the_unet_loss(tuned_unet):
    objective, state, batch = tuned_unet
    before = held_out_loss(objective, objective.variables, batch)
    after = held_out_loss(objective, state.variables, batch)
    assert after < 0.9 * before, (before, after)


def test_a_few_steps_lower_the_sd3_transformer_loss(pipelines):
    objective = DiffusionObjective.from_pipeline(pipelines["sd3"], SIZE)
    state, batch = fine_tune(objective, steps=12)
    before = held_out_loss(objective, objective.variables, batch)
    after = held_out_loss(objective, state.variables, batch)
    assert after < 0.9 * before, (before, after)


def test_lora_on_the_attention_projections_trains_factors_only(pipelines):
    pipeline = pipelines["sd15"]
    lora = LoRA(rank=4, modules=("to_q", "to_k", "to_v", "to_out_0"))
    objective = DiffusionObjective.from_pipeline(pipeline, SIZE, lora=lora, key=jax.random.key(1))
    kernels = objective.model.targets
    assert kernels and all(path.split("/")[-2] in ("to_q", "to_k", "to_v", "to_out_0") for path in kernels)
    state, batch = fine_tune(objective, steps=12, learning_rate=1e-2)
    factors = traverse_util.flatten_dict(state.variables["params"], sep="/")
    assert all(path.endswith(("lora_A", "lora_B")) for path in factors)
    before = held_out_loss(objective, objective.variables, batch)
    after = held_out_loss(objective, state.variables, batch)
    assert after < before, (before, after)
    # the base stays the pipeline's; merging folds the trained factors into a plain UNet's weights
    merged = objective.model.merge(state.variables)
    base = traverse_util.flatten_dict(dict(pipeline.denoiser.variables["params"]), sep="/")
    flat = traverse_util.flatten_dict(merged["params"], sep="/")
    changed = [path for path in flat if not np.array_equal(np.asarray(flat[path]), np.asarray(base[path]))]
    assert changed and set(changed) == set(kernels)
    with pytest.raises(ValueError, match="select no projection"):
        DiffusionObjective.from_pipeline(pipeline, SIZE, lora=LoRA(rank=2, modules=("q_proj",)), key=jax.random.key(1))


# --- (3) the fine-tuned UNet saves as a diffusers folder -------------------------------------------


def test_a_fine_tuned_unet_saves_and_reloads_with_the_trained_weights(tuned_unet, pipelines, tmp_path):
    objective, state, _ = tuned_unet
    PretrainedUNet.from_model(objective.model, state.variables).save(tmp_path / "unet")
    reloaded = PretrainedUNet.load(tmp_path / "unet")
    trained = traverse_util.flatten_dict(state.variables["params"], sep="/")
    read = traverse_util.flatten_dict(reloaded.variables["params"], sep="/")
    start = traverse_util.flatten_dict(pipelines["sd15"].denoiser.variables["params"], sep="/")
    assert set(read) == set(trained)
    for path in trained:
        np.testing.assert_array_equal(np.asarray(read[path]), np.asarray(trained[path]))
    assert any(not np.array_equal(np.asarray(trained[path]), np.asarray(start[path])) for path in trained)


@pytest.mark.reference
def test_diffusers_reads_the_fine_tuned_unet(tuned_unet, tmp_path):
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    objective, state, batch = tuned_unet
    saved = PretrainedUNet.from_model(objective.model, state.variables)
    saved.save(tmp_path / "unet")
    theirs = diffusers.UNet2DConditionModel.from_pretrained(tmp_path / "unet").eval()
    x = np.asarray(jax.random.normal(jax.random.key(4), (2, 8, 8, 4)))
    timesteps = np.array([10.0, 700.0], np.float32)
    states = batch["encoder_hidden_states"][:2]
    ours = np.asarray(saved(x, timesteps, {"encoder_hidden_states": states}))
    with torch.no_grad():
        out = theirs(torch.from_numpy(x.transpose(0, 3, 1, 2).copy()), torch.from_numpy(timesteps),
                     torch.from_numpy(np.array(states))).sample
    np.testing.assert_allclose(out.numpy().transpose(0, 2, 3, 1), ours, atol=1e-4, rtol=0)


@pytest.mark.reference
@pytest.mark.parametrize("family", ["sd15", "sd3"])
def test_the_loss_equals_diffusers_training_script_on_the_same_draws(pipelines, family):
    """train_text_to_image.py (SD) and train_dreambooth_sd3.py (weighting "none") with torch, on
    the latents, noise and table positions the objective draws for one step key."""
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    pipeline = pipelines[family]
    objective = DiffusionObjective.from_pipeline(pipeline, SIZE)
    batch = batch_of(objective)
    key = jax.random.key(21)
    loss, _ = jax.jit(objective.loss)(objective.variables, batch, Step(0, key))
    latents = np.asarray(pipeline.autoencoder.encode(to_unit_range(batch["image"])))
    u, noise = draws(key, latents.shape)
    indices = torch.from_numpy(np.floor(u * 1000).astype(np.int64))
    x0, eps = (torch.from_numpy(np.ascontiguousarray(a.transpose(0, 3, 1, 2))) for a in (latents, noise))
    folder = FIXTURES / family
    if family == "sd15":
        scheduler = diffusers.DDPMScheduler.from_pretrained(folder / "scheduler")
        network = diffusers.UNet2DConditionModel.from_pretrained(folder / "unet").eval()
        noisy = scheduler.add_noise(x0, eps, indices)
        with torch.no_grad():
            predicted = network(noisy, indices, torch.from_numpy(np.array(batch["encoder_hidden_states"]))).sample
        target = eps
    else:
        scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(folder / "scheduler")
        network = diffusers.SD3Transformer2DModel.from_pretrained(folder / "transformer").eval()
        timesteps = scheduler.timesteps[indices]
        sigmas = scheduler.sigmas[indices].reshape(-1, 1, 1, 1)
        noisy = (1.0 - sigmas) * x0 + sigmas * eps
        with torch.no_grad():
            predicted = network(hidden_states=noisy, timestep=timesteps,
                                encoder_hidden_states=torch.from_numpy(np.array(batch["encoder_hidden_states"])),
                                pooled_projections=torch.from_numpy(np.array(batch["pooled_projections"]))).sample
        target = eps - x0
    expected = torch.nn.functional.mse_loss(predicted.float(), target.float()).item()
    np.testing.assert_allclose(float(loss), expected, rtol=1e-4)
