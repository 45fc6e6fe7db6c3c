"""img2img, inpainting and the SDXL base -> refiner handoff against diffusers' recordings.

tools/image_workflow_fixtures.py records StableDiffusion(XL) img2img, inpainting (9-channel and
4-channel) and refiner pipelines on the tiny fixture pipelines, from a fixed image, mask and noise,
guidance 5.0 (tests/fixtures/pipelines/image_workflows).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.inference.image import PreparedImages, strength_start
from dew.interop import diffusion_pipelines
from dew.interop.diffusion_pipelines import DiffusionPipeline
from dew.interop.handoff import denoising_split
from dew.interop.schedulers import DEFAULTS, SourceScheduler
from dew.interop.unet_condition import PretrainedUNet

PIPELINES = pathlib.Path(__file__).parent / "fixtures" / "pipelines"
HERE = PIPELINES / "image_workflows"
PROMPTS = ["a photo of a cat", "A red flower!"]
TOLERANCE = 1e-3


def nhwc(array):
    return jnp.asarray(np.transpose(array, (0, 2, 3, 1)))


@pytest.fixture(scope="module")
def reference():
    with np.load(HERE / "reference.npz") as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope="module")
def load():
    patch = pytest.MonkeyPatch()
    for name in DEFAULTS:  # the scheduler registry is filled elsewhere; these tests read the rebuilds
        patch.setitem(diffusion_pipelines.SCHEDULERS, name, SourceScheduler.from_config)
    cache = {}

    def loaded(name):
        if name not in cache:
            cache[name] = DiffusionPipeline.load(PIPELINES / name)
        return cache[name]

    yield loaded
    patch.undo()


@pytest.fixture(scope="module")
def sd15(load):
    """The sd15 pipeline with the DDIM scheduler the recordings swapped in (clip_sample off)."""
    config = json.loads((PIPELINES / "sd15" / "scheduler" / "scheduler_config.json").read_text())
    ddim = SourceScheduler.from_config({**config, "_class_name": "DDIMScheduler", "clip_sample": False})
    task = load("sd15").text_to_image(steps=5, guidance=5.0)
    return dataclasses.replace(task, process=ddim.process, solver=ddim.solver)


def close(actual, expected, name):
    error = float(np.max(np.abs(np.asarray(actual) - expected)))
    print(f"{name}: {error:.2e}")
    assert error < TOLERANCE, f"{name}: max |Dew - diffusers| = {error:.2e}"
    return error


def images(result):
    return (np.asarray(result.images) + 1.0) / 2.0


def test_strength_picks_diffusers_start_index():
    assert [strength_start(5, s) for s in (1.0, 0.8, 0.6, 0.5, 0.2, 0.1)] == [0, 1, 2, 3, 4, 5]
    for bad in (0.0, -0.1, 1.5, True):
        with pytest.raises(ValueError, match=r"strength must be a number in \(0, 1\]"):
            strength_start(5, bad)


def test_image_encodes_to_the_posterior_mean(sd15, reference):
    prepared = sd15.prepare(PROMPTS, image=reference["image"], strength=0.6)
    close(prepared.image_latents, nhwc(reference["sd15_image_latents"]), "image latents")
    drawn = sd15.prepare(PROMPTS, image=reference["image"], strength=0.6, encode_key=jax.random.key(0))
    assert float(jnp.max(jnp.abs(drawn.image_latents - prepared.image_latents))) > 1e-3  # a posterior draw


def test_sd15_img2img_matches_diffusers(sd15, reference):
    prepared = sd15.prepare(PROMPTS, image=reference["image"], strength=0.6, noise=nhwc(reference["sd15_noise"]))
    assert (prepared.start, prepared.stop) == (2, 5)
    result = sd15(prepared, seed=0)
    close(result.latents, nhwc(reference["sd15_img2img/latents"]), "latents")
    close(images(result), reference["sd15_img2img/images"], "images")
    # negative control: the same three steps started one index early on the grid (an off-by-one
    # strength mapping); same shapes, so the compiled run is reused
    shifted = sd15(sd15.prepare(PROMPTS, image=reference["image"], times=(1, 4), noise=nhwc(reference["sd15_noise"])),
                   seed=0, decode=False)
    assert np.max(np.abs(np.asarray(shifted.latents) - nhwc(reference["sd15_img2img/latents"]))) > 0.05


def test_unconditional_prompts_replace_the_empty_prompt(sd15, reference):
    common = dict(image=reference["image"], strength=0.6, noise=nhwc(reference["sd15_noise"]))
    negative = sd15(sd15.prepare(PROMPTS, unconditional=["a photo of a dog"], **common), seed=0, decode=False)
    close(negative.latents, nhwc(reference["sd15_img2img_negative/latents"]), "negative prompt latents")
    assert negative.images is None
    rows = sd15.prepare(["a photo of a dog"], strength=0.6, image=reference["image"][:1]).conditions
    encoded = sd15(sd15.prepare(PROMPTS, unconditional=rows, **common), seed=0, decode=False)
    np.testing.assert_allclose(encoded.latents, negative.latents, atol=1e-6)
    plain = sd15(sd15.prepare(PROMPTS, **common), seed=0, decode=False)
    assert np.max(np.abs(np.asarray(plain.latents) - np.asarray(negative.latents))) > 0.05


def test_sd15_inpainting_with_a_9_channel_unet_matches_diffusers(sd15, reference):
    unet = PretrainedUNet.load(HERE / "inpaint_unet")
    task = dataclasses.replace(sd15, model=unet.model, variables=unet.variables)
    prepared = task.prepare(PROMPTS, image=reference["image"], mask=reference["mask"], strength=1.0,
                            noise=nhwc(reference["sd15_noise"]))
    result = task(prepared, seed=0)
    close(result.latents, nhwc(reference["sd15_inpaint9/latents"]), "latents")
    close(images(result), reference["sd15_inpaint9/images"], "images")
    inverted = task(task.prepare(PROMPTS, image=reference["image"], mask=1.0 - reference["mask"],
                                 noise=nhwc(reference["sd15_noise"])), seed=0, decode=False)
    assert np.max(np.abs(np.asarray(inverted.latents) - nhwc(reference["sd15_inpaint9/latents"]))) > 0.05


def test_sd15_inpainting_with_a_4_channel_blend_matches_diffusers(sd15, reference):
    prepared = sd15.prepare(PROMPTS, image=reference["image"], mask=reference["mask"], strength=0.8,
                            noise=nhwc(reference["sd15_noise"]))
    assert prepared.repaint is not None
    result = sd15(prepared, seed=0)
    close(result.latents, nhwc(reference["sd15_inpaint4/latents"]), "latents")
    close(images(result), reference["sd15_inpaint4/images"], "images")
    inverted = sd15(sd15.prepare(PROMPTS, image=reference["image"], mask=1.0 - reference["mask"], strength=0.8,
                                 noise=nhwc(reference["sd15_noise"])), seed=0, decode=False)
    assert np.max(np.abs(np.asarray(inverted.latents) - nhwc(reference["sd15_inpaint4/latents"]))) > 0.05


@pytest.mark.slow  # the SD 1.5 test covers img2img in the default run; this adds SDXL's time ids and Euler
def test_sdxl_img2img_matches_diffusers(load, reference):
    task = load("sdxl").text_to_image(steps=6, guidance=5.0)
    prepared = task.prepare(PROMPTS, image=reference["image"], strength=0.6, noise=nhwc(reference["sdxl_noise"]))
    result = task(prepared, seed=0)
    close(result.latents, nhwc(reference["sdxl_img2img/latents"]), "latents")
    close(images(result), reference["sdxl_img2img/images"], "images")


def test_sdxl_base_hands_off_to_the_refiner_as_diffusers_does(load, reference):
    base = load("sdxl").text_to_image(steps=6, guidance=5.0)
    split = denoising_split(load("sdxl").scheduler, 6, 0.6)
    assert split == 3
    handed = base(base.prepare(PROMPTS, times=(0, split), noise=nhwc(reference["sdxl_latents"])), seed=0,
                  decode=False)
    assert handed.images is None
    close(handed.latents, nhwc(reference["sdxl_base/latents"]), "base latents")

    refiner = load("image_workflows/refiner").text_to_image(steps=6, guidance=5.0)
    result = refiner(refiner.prepare(PROMPTS, initial=handed.latents, times=split), seed=0)
    close(result.latents, nhwc(reference["sdxl_refiner/latents"]), "refiner latents")
    close(images(result), reference["sdxl_refiner/images"], "refiner images")
    # negative control: the refiner's steps placed one index early (the base's last level handed to it)
    early = refiner(refiner.prepare(PROMPTS, initial=handed.latents, times=(split - 1, 5)), seed=0, decode=False)
    assert np.max(np.abs(np.asarray(early.latents) - nhwc(reference["sdxl_refiner/latents"]))) > 0.05


def test_refiner_negative_prompts_keep_the_negative_aesthetic_score(load):
    refiner = load("image_workflows/refiner").text_to_image(steps=6, guidance=5.0)
    prepared = refiner.prepare(PROMPTS, unconditional=["a photo of a dog"])
    np.testing.assert_array_equal(prepared.null["time_ids"][:, -1], [2.5, 2.5])
    np.testing.assert_array_equal(prepared.conditions["time_ids"][:, -1], [6.0, 6.0])
    empty = refiner.prepare(PROMPTS)
    assert float(jnp.max(jnp.abs(prepared.null["encoder_hidden_states"] - empty.null["encoder_hidden_states"]))) > 1e-3


def test_bad_inputs_fail_early_with_what_was_expected(sd15, reference):
    image = reference["image"]
    with pytest.raises(ValueError, match=r"mask must be a pixel mask \[batch, 16, 16, 1\]"):
        sd15.prepare(PROMPTS, image=image, mask=reference["mask"][..., 0])
    with pytest.raises(ValueError, match="multiples of 2"):
        sd15.prepare(PROMPTS, image=image[:, :15, :15], strength=0.5)
    with pytest.raises(ValueError, match="initial= is a state that is already noisy"):
        sd15.prepare(PROMPTS, initial=np.zeros((2, 8, 8, 4), np.float32), strength=0.5)
    with pytest.raises(ValueError, match=r"strength must be a number in \(0, 1\]"):
        sd15.prepare(PROMPTS, image=image, strength=1.5)
    with pytest.raises(ValueError, match="not both"):
        sd15.prepare(PROMPTS, image=image, strength=0.5, times=2)
    with pytest.raises(ValueError, match="times must be a step index"):
        sd15.prepare(PROMPTS, image=image, times=5)
    with pytest.raises(ValueError, match="needs a state there"):
        sd15.prepare(PROMPTS, times=2)
    with pytest.raises(ValueError, match="floats must lie in"):
        sd15.prepare(PROMPTS, image=image.astype(np.float32), strength=0.5)
    with pytest.raises(ValueError, match="noise must have the latents' shape"):
        sd15.prepare(PROMPTS, image=image, strength=0.5, noise=np.zeros((2, 4, 8, 8), np.float32))
    prepared = sd15.prepare(PROMPTS, image=image, strength=0.5)
    assert isinstance(prepared, PreparedImages)
    with pytest.raises(ValueError, match="prepare it again with steps="):
        sd15(prepared, seed=0, steps=4)


# --- the same machinery on a tiny analytic model (pixel space, no autoencoder) -----------------------

DDIM_CONFIG = {"_class_name": "DDIMScheduler", "beta_schedule": "scaled_linear", "beta_start": 0.00085,
               "beta_end": 0.012, "set_alpha_to_one": False, "steps_offset": 1, "clip_sample": False}


@dataclasses.dataclass(frozen=True)
class Smooth:
    """An epsilon prediction that depends on the input and the timestep (no weights, no conditions)."""

    def apply(self, variables, x, timesteps, conditions):
        return 0.7 * jnp.tanh(x) + 0.002 * timesteps[:, None, None, None]


def tiny(class_name="DDIMScheduler", **settings):
    from dew.inference.image import TextToImage

    scheduler = SourceScheduler.from_config({**DDIM_CONFIG, "_class_name": class_name, **settings})
    return TextToImage(Smooth(), {}, scheduler.process, (8, 8, 3), solver=scheduler.solver, steps=6)


def test_a_prepared_text_to_image_run_draws_what_a_plain_call_draws():
    task = tiny()
    plain = task(["", ""], seed=3)
    prepared = task(task.prepare(["", ""]), seed=3)
    np.testing.assert_array_equal(prepared.images, plain.images)
    raw = task(["", ""], seed=3, decode=False)
    assert raw.images is None and plain.latents is None
    assert float(jnp.max(jnp.abs(raw.latents))) > 1.0  # unclipped
    np.testing.assert_allclose(jnp.clip(raw.latents, -1, 1), plain.images, atol=1e-6)


def test_a_run_split_in_two_through_initial_continues_where_it_stopped():
    task = tiny()  # DDIM without alpha = 1 at the end: the handed latents are in the scheduler's space
    noise = np.random.default_rng(0).normal(size=(2, 8, 8, 3)).astype(np.float32)
    whole = task(task.prepare(["", ""], noise=noise), seed=0, decode=False).latents
    first = task(task.prepare(["", ""], noise=noise, times=(0, 4)), seed=0, decode=False).latents
    second = task(task.prepare(["", ""], initial=first, times=4), seed=0, decode=False).latents
    np.testing.assert_allclose(second, whole, atol=1e-5)
    # negative control: the handed state taken as sigma space, without undoing the scheduler's scale
    unscaled = dataclasses.replace(task.prepare(["", ""], initial=first, times=4), initial=jnp.asarray(first))
    assert float(jnp.max(jnp.abs(task(unscaled, seed=0, decode=False).latents - whole))) > 1e-3


def test_img2img_starts_from_the_image_noised_to_the_grid_level():
    task = tiny()
    image = np.random.default_rng(1).integers(0, 256, (1, 8, 8, 3), dtype=np.uint8)
    noise = np.random.default_rng(2).normal(size=(2, 8, 8, 3)).astype(np.float32)
    prepared = task.prepare(["", ""], image=image, strength=0.5, noise=noise)
    assert (prepared.start, prepared.stop) == (3, 6)
    np.testing.assert_allclose(prepared.image_latents[1], image[0] / 127.5 - 1.0, atol=1e-6)  # one row, repeated
    same = task.prepare(["", ""], image_latents=prepared.image_latents, strength=0.5, noise=noise)
    np.testing.assert_array_equal(task(same, seed=0).images, task(prepared, seed=0).images)


def test_blended_inpainting_needs_a_solver_whose_steps_stand_alone():
    task = tiny("PNDMScheduler", skip_prk_steps=True)
    image = np.zeros((2, 8, 8, 3), np.uint8)
    mask = np.ones((2, 8, 8, 1), np.float32)
    prepared = task.prepare(["", ""], image=image, mask=mask, strength=0.5)
    with pytest.raises(ValueError, match="PNDM carries state between steps"):
        task(prepared, seed=0)


def test_an_inpainting_pipeline_directory_loads_its_9_channel_unet(load, tmp_path, reference):
    folder = tmp_path / "inpaint"
    folder.mkdir()
    index = json.loads((PIPELINES / "sd15" / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusionInpaintPipeline"}))
    for name in ("scheduler", "text_encoder", "tokenizer", "vae"):
        (folder / name).symlink_to(PIPELINES / "sd15" / name, target_is_directory=True)
    (folder / "unet").symlink_to(HERE / "inpaint_unet", target_is_directory=True)
    task = DiffusionPipeline.load(folder).text_to_image()
    assert (task.model.in_channels, task.guidance.scale, task.steps) == (9, 7.5, 50)
    prepared = task.prepare(PROMPTS, image=reference["image"], mask=reference["mask"])
    assert prepared.repaint is None and prepared.conditions["masked_image_latents"].shape == (2, 8, 8, 4)
    with pytest.raises(ValueError, match="reads the masked image's latents: pass image="):
        task.prepare(PROMPTS, image_latents=prepared.image_latents, mask=reference["mask"])
