"""Published pipelines end to end: prompts -> the source's own scheduler -> denoiser -> VAE, against
the latents and images diffusers produced from the same starting latents
(tools/diffusion_pipeline_fixtures.py: 4 steps, guidance 5.0, 16 x 16 pixels)."""

from __future__ import annotations

import dataclasses
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop.diffusion_pipelines import DiffusionPipeline
from dew.interop.schedulers import SourceScheduler
from dew.sampling.guidance import CFG

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "pipelines"
PROMPTS = ["a photo of a cat", "A red flower!"]  # the two captions the fixtures drew
STEPS, GUIDANCE, SIDE = 4, 5.0, 16
# float32 on CPU: latents (magnitudes up to ~20) agree to about 5e-5, images in [0, 1] to about 5e-6
LATENT_TOLERANCE, IMAGE_TOLERANCE = 1e-3, 1e-4
# the second scheduler each fixture recorded: diffusers' from_config(shipped config, **overrides)
SECOND = {"sd15": ("DDIMScheduler", "DDIMScheduler", {"clip_sample": False}),
          "sdxl": ("DPMSolverMultistepScheduler", "DPMSolverMultistepScheduler", {}),
          "flux": ("FlowMatchEulerDiscreteScheduler-karras", "FlowMatchEulerDiscreteScheduler",
                   {"use_karras_sigmas": True})}


@dataclasses.dataclass(frozen=True)
class StartingLatents:
    """A source scheduler's process that starts from given unit Gaussian latents (the pipeline's
    ``latents=``) instead of drawing them."""

    process: object
    latents: jnp.ndarray

    def noise(self, key, shape, dtype=jnp.float32, *, steps):
        return self.process.scheduler.initial(self.latents, self.process.sigmas(steps)).astype(dtype)

    def __getattr__(self, name):
        return getattr(self.process, name)


@pytest.fixture(scope="module")
def pipelines():
    return {}


def loaded(pipelines, family):
    if family not in pipelines:
        pipelines[family] = DiffusionPipeline.load(FIXTURES / family)
    return pipelines[family]


def starting_latents(family, latents):
    """The recorded starting latents as Dew's [B, H, W, C] (Flux's are packed 2 x 2: [B, HW/4, 4C])."""
    if family == "flux":
        b, tokens, packed = latents.shape
        side, channels = int(round(tokens ** 0.5)), packed // 4
        latents = latents.reshape(b, side, side, channels, 2, 2).transpose(0, 3, 1, 4, 2, 5)
        latents = latents.reshape(b, channels, 2 * side, 2 * side)
    return jnp.asarray(latents.transpose(0, 2, 3, 1))


def draw(pipeline, family, *, scheduler=None, guidance=GUIDANCE):
    """Dew's latents [B, C, H, W] and images [B, H, W, 3] in [0, 1], as the fixtures recorded them."""
    if scheduler is not None:
        pipeline = dataclasses.replace(pipeline, scheduler=scheduler)
    task = pipeline.text_to_image(height=SIDE, width=SIDE, steps=STEPS, guidance=GUIDANCE)
    if guidance is not GUIDANCE:
        task = dataclasses.replace(task, guidance=guidance)
    reference = np.load(FIXTURES / family / "reference.npz")
    task = dataclasses.replace(task, process=StartingLatents(task.process, starting_latents(family, reference["latents"])))
    out = task(PROMPTS, seed=0)
    return np.asarray(out.latents).transpose(0, 3, 1, 2), np.clip(np.asarray(out.images) / 2 + 0.5, 0.0, 1.0)


def rebuilt(pipeline, class_name, **overrides):
    """The pipeline's scheduler swapped for ``class_name`` as diffusers' from_config(config, **overrides)."""
    shipped = pipeline.scheduler
    config = {**shipped.to_config(), "_class_name": class_name, **overrides}
    return SourceScheduler.from_config(config, pipeline_sigmas=shipped.pipeline_sigmas,
                                       model_timestep_scale=shipped.model_timestep_scale)


def assert_matches(family, label, latents, images):
    reference = np.load(FIXTURES / family / "reference.npz")
    np.testing.assert_allclose(latents, reference[f"{label}/latents"], atol=LATENT_TOLERANCE, rtol=0)
    np.testing.assert_allclose(images, reference[f"{label}/images"], atol=IMAGE_TOLERANCE, rtol=0)


def assert_differs(family, label, latents):
    reference = np.load(FIXTURES / family / "reference.npz")
    assert np.abs(latents - reference[f"{label}/latents"]).max() > 100 * LATENT_TOLERANCE


@pytest.mark.parametrize("family", ["sd15", "sdxl", "sd3", "flux"])
def test_the_shipped_scheduler_draws_the_pipelines_images(pipelines, family):
    pipeline = loaded(pipelines, family)
    assert_matches(family, pipeline.scheduler.class_name, *draw(pipeline, family))


@pytest.mark.parametrize("family", sorted(SECOND))
def test_a_swapped_scheduler_draws_the_pipelines_images(pipelines, family):
    pipeline = loaded(pipelines, family)
    label, class_name, overrides = SECOND[family]
    assert_matches(family, label, *draw(pipeline, family, scheduler=rebuilt(pipeline, class_name, **overrides)))


def test_sd3s_second_recorded_scheduler_flow_match_heun_is_refused(pipelines):
    """FlowMatchHeunDiscreteScheduler (SD3's second recording) has no rebuild yet: it raises, naming it,
    rather than sampling with another scheduler."""
    with pytest.raises(ValueError, match="FlowMatchHeunDiscreteScheduler"):
        rebuilt(loaded(pipelines, "sd3"), "FlowMatchHeunDiscreteScheduler")


def test_negative_control_a_wrong_timestep_spacing_is_caught(pipelines):
    pipeline = loaded(pipelines, "sd15")
    wrong = rebuilt(pipeline, "PNDMScheduler", timestep_spacing="trailing")
    latents, _ = draw(pipeline, "sd15", scheduler=wrong)
    assert_differs("sd15", "PNDMScheduler", latents)


def test_negative_control_a_wrong_shift_is_caught(pipelines):
    pipeline = loaded(pipelines, "sd3")
    wrong = rebuilt(pipeline, "FlowMatchEulerDiscreteScheduler", shift=1.0)
    latents, _ = draw(pipeline, "sd3", scheduler=wrong)
    assert_differs("sd3", "FlowMatchEulerDiscreteScheduler", latents)


def test_negative_control_guidance_on_the_wrong_branch_is_caught(pipelines):
    """D_c + s (D_u - D_c), guidance pushing away from the prompt, is CFG(1 - s)."""
    pipeline = loaded(pipelines, "sdxl")
    latents, _ = draw(pipeline, "sdxl", guidance=CFG(1.0 - GUIDANCE))
    assert_differs("sdxl", "EulerDiscreteScheduler", latents)


def test_flux_reads_guidance_as_its_embedded_scale(pipelines):
    """For guidance-distilled Flux, guidance= sets the scale its transformer reads (no second branch);
    a transformer without guidance embeddings refuses it."""
    pipeline = loaded(pipelines, "flux")
    task = pipeline.text_to_image(guidance=2.0)
    assert task.guidance is None and task.conditions["prompt"].guidance == 2.0
    assert pipeline.prompts.guidance == 3.5  # the loaded pipeline keeps FluxPipeline's default
    without = dataclasses.replace(pipeline, prompts=_without_guidance(pipeline.prompts))
    with pytest.raises(ValueError, match="no guidance embedding"):
        without.text_to_image(guidance=2.0)


def _without_guidance(prompts):
    import copy

    prompts = copy.copy(prompts)
    prompts.guidance = None
    return prompts


# --- saving the pipeline directory back -----------------------------------------------------------


def leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def assert_bitwise(a, b):
    assert len(leaves(a)) == len(leaves(b)) > 0
    for x, y in zip(leaves(a), leaves(b)):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("family", ["sd15", "sd3"])
def test_a_saved_pipeline_reloads_with_bitwise_weights_and_its_scheduler(pipelines, family, tmp_path):
    pipeline = loaded(pipelines, family)
    again = DiffusionPipeline.load(pipeline.save(tmp_path / family))
    assert again.index.pipeline_class == pipeline.index.pipeline_class
    assert again.index.settings == pipeline.index.settings and again.scheduler == pipeline.scheduler
    assert_bitwise(again.denoiser.variables, pipeline.denoiser.variables)
    assert_bitwise(again.autoencoder.variables, pipeline.autoencoder.variables)
    for name, _ in pipeline.index.family.encoders:
        assert_bitwise(getattr(again.prompts, name).variables, getattr(pipeline.prompts, name).variables)
    encoded, encoded_again = pipeline.prompts.encode_texts(PROMPTS), again.prompts.encode_texts(PROMPTS)
    for key in encoded:
        np.testing.assert_array_equal(np.asarray(encoded_again[key]), np.asarray(encoded[key]))


def test_a_saved_pipeline_draws_the_same_images(pipelines, tmp_path):
    pipeline = loaded(pipelines, "sd15")
    again = DiffusionPipeline.load(pipeline.save(tmp_path / "sd15"))
    assert_matches("sd15", "PNDMScheduler", *draw(again, "sd15"))
    with pytest.raises(FileExistsError, match="not empty"):
        pipeline.save(tmp_path / "sd15")


@pytest.mark.reference
@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_diffusers_loads_a_saved_pipeline_and_draws_the_recorded_images(pipelines, family, tmp_path):
    import diffusers
    import torch

    directory = loaded(pipelines, family).save(tmp_path / family)
    pipe = diffusers.DiffusionPipeline.from_pretrained(directory, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    reference = np.load(FIXTURES / family / "reference.npz")
    images = pipe(prompt=PROMPTS, num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=SIDE, width=SIDE,
                  latents=torch.from_numpy(reference["latents"]), generator=torch.Generator().manual_seed(0),
                  output_type="np").images
    label = type(pipe.scheduler).__name__
    np.testing.assert_allclose(images, reference[f"{label}/images"], atol=1e-5, rtol=0)
