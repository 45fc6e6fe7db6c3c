"""diffusers pipeline directories: model_index.json, component loading and prompt encoding with
diffusers parity, against the fixtures of tools/diffusion_pipeline_fixtures.py."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from dew.data.caption_tokens import CaptionTokens
from dew.data.clip_bpe import clip_bpe
from dew.data.tokenizers import HFTokenizer
from dew.interop import diffusion_pipelines, pipeline_prompts
from dew.interop.diffusion_pipelines import (
    DiffusionPipeline,
    caption_tokens,
    load_autoencoder,
    load_prompts,
    read_model_index,
)
from dew.interop.pipeline_prompts import FluxPrompts, SD3Prompts, SDXLPrompts, StableDiffusionPrompts

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "pipelines"
PROMPTS = ["a photo of a cat", "A red flower!", ""]  # as tools/diffusion_pipeline_fixtures.py
# float32 on CPU: the CLIP-only encodings agree to 1e-6; T5's two layers of softmax over 256-512
# positions (SD3, Flux) to about 3e-5.
TOLERANCE = {"sd15": 1e-5, "sdxl": 1e-5, "sd3": 5e-5, "flux": 5e-5}
REFERENCE_KEYS = {"encoder_hidden_states": "prompt_embeds", "text_embeds": "pooled_prompt_embeds",
                  "pooled_projections": "pooled_prompt_embeds"}


def reference(family):
    return np.load(FIXTURES / family / "reference.npz")


@pytest.fixture(scope="module")
def prompts():
    return {family: load_prompts(FIXTURES / family) for family in ("sd15", "sdxl", "sd3", "flux")}


def copy_pipeline(tmp_path, family):
    return pathlib.Path(shutil.copytree(FIXTURES / family, tmp_path / family))


def edit_index(directory, **changes):
    path = directory / "model_index.json"
    index = json.loads(path.read_text())
    index.update(changes)
    path.write_text(json.dumps(index))


# --- model_index.json -----------------------------------------------------------------------------


def test_model_index_names_the_pipeline_class_its_components_and_settings():
    index = read_model_index(FIXTURES / "sd15")
    assert index.pipeline_class == "StableDiffusionPipeline"
    assert index.components["unet"] == ("diffusers", "UNet2DConditionModel")
    assert index.components["tokenizer"] == ("transformers", "CLIPTokenizer")
    assert "safety_checker" not in index.components  # written [null, null]
    assert index.settings == {"requires_safety_checker": False}
    assert read_model_index(FIXTURES / "sdxl").settings["force_zeros_for_empty_prompt"] is True
    assert read_model_index(FIXTURES / "flux").family.denoiser == "transformer"


def test_an_unknown_pipeline_class_is_refused_naming_those_dew_reads(tmp_path):
    directory = copy_pipeline(tmp_path, "sd15")
    edit_index(directory, _class_name="KandinskyV22Pipeline")
    with pytest.raises(ValueError, match="KandinskyV22Pipeline.*StableDiffusionXLPipeline"):
        read_model_index(directory)


def test_a_directory_without_model_index_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model_index.json"):
        read_model_index(tmp_path)


def test_a_missing_component_folder_is_named(tmp_path):
    directory = copy_pipeline(tmp_path, "sdxl")
    shutil.rmtree(directory / "text_encoder_2")
    with pytest.raises(FileNotFoundError, match="'text_encoder_2'.*does not exist"):
        load_prompts(directory)


# --- components -----------------------------------------------------------------------------------


def test_components_load_with_the_structure_model_index_names(prompts):
    sdxl = prompts["sdxl"]
    assert isinstance(sdxl, SDXLPrompts)
    assert sdxl.text_encoder.model.projection_dim is None  # CLIPTextModel
    assert sdxl.text_encoder_2.model.projection_dim == 24  # CLIPTextModelWithProjection
    assert sdxl.text_encoder_2.tokens.tokenizer.pad_id == sdxl.text_encoder_2.tokens.tokenizer.token_to_id("!")
    assert sdxl.original_size == (16, 16)  # the UNet's sample_size times the VAE's downsampling
    assert isinstance(prompts["sd15"], StableDiffusionPrompts)
    sd3, flux = prompts["sd3"], prompts["flux"]
    assert isinstance(sd3, SD3Prompts) and sd3.text_encoder_3.tokens.max_length == 256
    assert isinstance(flux, FluxPrompts) and flux.text_encoder_2.tokens.max_length == 512
    assert flux.guidance == 3.5  # the transformer has guidance embeddings
    autoencoder = load_autoencoder(read_model_index(FIXTURES / "sd3"))
    assert autoencoder.model.latent_channels == 16 and autoencoder.model.shift_factor == pytest.approx(0.0609)


def test_clip_tokenizer_files_read_as_transformers_reads_them(tmp_path):
    """vocab.json + merges.txt (no tokenizer.json) give the rows the prompt encodings were made
    from; saved, the tokenizer becomes a tokenizer.json that reads back to the same rows."""
    folder = FIXTURES / "sdxl" / "tokenizer_2"
    assert not (folder / "tokenizer.json").exists()
    tokens = caption_tokens(folder, 16)
    ids, _ = tokens(PROMPTS)
    pad, start, end = (tokens.tokenizer.token_to_id(t) for t in ("!", "<|startoftext|>", "<|endoftext|>"))
    assert ids[2].tolist() == [start, end] + [pad] * 14  # the empty prompt
    assert ids[1, ids[1].tolist().index(end) - 1] == pad  # the "!" of "flower!" is the pad token, as in transformers
    saved = tokens.tokenizer.save(tmp_path / "saved")
    np.testing.assert_array_equal(CaptionTokens(saved, 16)(PROMPTS)[0], ids)


def test_a_tokenizer_folder_without_usable_files_names_what_it_needs(tmp_path):
    (tmp_path / "spiece.model").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"tokenizer.json, or vocab.json \+ merges.txt"):
        caption_tokens(tmp_path, 16)
    backend, config = clip_bpe(FIXTURES / "sd15" / "tokenizer")
    assert config["pad_token"] == "<|endoftext|>" and HFTokenizer(FIXTURES / "sd15" / "tokenizer", backend=backend,
                                                                   config=config).pad_id == backend.token_to_id("<|endoftext|>")


# --- prompt encoding parity -----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["sd15", "sdxl", "sd3", "flux"])
def test_prompt_encodings_match_diffusers_encode_prompt(prompts, family):
    ref = reference(family)
    conditional = prompts[family].encode_texts(PROMPTS)
    unconditional = prompts[family].encode_texts([None] * len(PROMPTS))
    for key, name in REFERENCE_KEYS.items():
        if key not in conditional:
            continue
        np.testing.assert_allclose(np.asarray(conditional[key]), ref[name], atol=TOLERANCE[family], rtol=0)
        if f"negative_{name}" in ref:
            np.testing.assert_allclose(np.asarray(unconditional[key]),
                                       np.repeat(ref[f"negative_{name}"], len(PROMPTS), axis=0), atol=TOLERANCE[family], rtol=0)
    if family == "sdxl":
        np.testing.assert_array_equal(np.asarray(conditional["time_ids"]), np.repeat(ref["time_ids"], 3, axis=0))
        assert not np.asarray(unconditional["encoder_hidden_states"]).any()  # force_zeros_for_empty_prompt
    if family == "flux":
        np.testing.assert_array_equal(np.asarray(conditional["guidance"]), [3.5] * 3)


def test_unconditional_rows_mix_with_prompts_and_differ_from_an_explicit_empty_prompt(prompts):
    """None is the unconditional branch (zeros for SDXL); "" is a prompt, encoded as diffusers encodes it."""
    ref = reference("sdxl")
    mixed = prompts["sdxl"].encode_texts(["a photo of a cat", None, ""])
    states = np.asarray(mixed["encoder_hidden_states"])
    np.testing.assert_allclose(states[[0, 2]], ref["prompt_embeds"][[0, 2]], atol=TOLERANCE["sdxl"], rtol=0)
    assert not states[1].any() and not np.asarray(mixed["text_embeds"][1]).any()
    with pytest.raises(TypeError, match="prompts"):
        prompts["sdxl"].encode_texts([7])


def test_negative_controls_the_parity_check_catches_realistic_mistakes(prompts):
    """SDXL read from the last layer instead of the penultimate, SD3's CLIP states zero-padded on the
    wrong side, SDXL's unconditional rows encoded from "" despite force_zeros_for_empty_prompt."""
    sdxl, sd3 = prompts["sdxl"], prompts["sd3"]
    ids = [jnp.asarray(encoder.tokens(PROMPTS)[0]) for encoder in (sdxl.text_encoder, sdxl.text_encoder_2)]
    outputs = [pipeline_prompts._apply(encoder.model, encoder.variables, i)
               for encoder, i in zip((sdxl.text_encoder, sdxl.text_encoder_2), ids)]
    last = np.concatenate([np.asarray(out.last) for out in outputs], axis=-1)
    penultimate = np.concatenate([np.asarray(out.penultimate) for out in outputs], axis=-1)
    expected = reference("sdxl")["prompt_embeds"]
    assert np.abs(penultimate - expected).max() < TOLERANCE["sdxl"]
    assert np.abs(last - expected).max() > 100 * TOLERANCE["sdxl"]
    assert np.abs(penultimate[2] - reference("sdxl")["negative_prompt_embeds"][0]).max() > 100 * TOLERANCE["sdxl"]

    states = np.asarray(sd3.encode_texts(PROMPTS)["encoder_hidden_states"])
    clip_width = sd3.text_encoder.model.hidden_size + sd3.text_encoder_2.model.hidden_size
    wrong_side = states.copy()
    wrong_side[:, :16] = np.roll(states[:, :16], states.shape[-1] - clip_width, axis=-1)  # zeros first
    expected = reference("sd3")["prompt_embeds"]
    assert np.abs(states - expected).max() < TOLERANCE["sd3"]
    assert np.abs(wrong_side - expected).max() > 100 * TOLERANCE["sd3"]


def test_the_refiner_reads_the_second_encoder_alone_and_scores_aesthetics(tmp_path):
    """StableDiffusionXLImg2ImgPipeline without text_encoder: the states are the second encoder's
    part of SDXL's (the same weights), the time ids end with the (negative) aesthetic score, and
    without force_zeros_for_empty_prompt the unconditional rows encode ""."""
    directory = copy_pipeline(tmp_path, "sdxl")
    shutil.rmtree(directory / "text_encoder")
    shutil.rmtree(directory / "tokenizer")
    edit_index(directory, _class_name="StableDiffusionXLImg2ImgPipeline", text_encoder=[None, None],
               tokenizer=[None, None], requires_aesthetics_score=True, force_zeros_for_empty_prompt=False)
    refiner = load_prompts(directory)
    ref = reference("sdxl")
    out = refiner.encode_texts(["a photo of a cat", None, "A red flower!"])
    rows = [0, 2, 1]
    np.testing.assert_allclose(np.asarray(out["encoder_hidden_states"]), ref["prompt_embeds"][rows, :, 32:], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(out["text_embeds"]), ref["pooled_prompt_embeds"][rows], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(out["time_ids"]), [[16, 16, 0, 0, 6.0], [16, 16, 0, 0, 2.5], [16, 16, 0, 0, 6.0]])


@pytest.mark.parametrize("family", ["sd15", "sdxl", "sd3", "flux"])
def test_the_vae_decodes_the_pipelines_latents_to_its_images(family):
    """The second half of each pipeline: its output latents (unscaled by scaling_factor, shifted by
    shift_factor for SD3 and Flux) through its vae/ give the images diffusers returned, to [0, 1]."""
    ref = reference(family)
    autoencoder = load_autoencoder(read_model_index(FIXTURES / family))
    label = next(key for key in ref.files if key.endswith("/latents"))
    latents = jnp.asarray(ref[label].transpose(0, 2, 3, 1))
    images = np.clip(np.asarray(autoencoder.decode(latents)) / 2 + 0.5, 0.0, 1.0)
    expected = ref[label.replace("/latents", "/images")]
    np.testing.assert_allclose(images, expected, atol=1e-5, rtol=0)
    if family == "sd3":  # negative control: the shift factor left out
        unshifted = dataclasses.replace(autoencoder, model=autoencoder.model.clone(shift_factor=0.0))
        wrong = np.clip(np.asarray(unshifted.decode(latents)) / 2 + 0.5, 0.0, 1.0)
        assert np.abs(wrong - expected).max() > 100 * 1e-5


# --- denoiser and scheduler registries ------------------------------------------------------------


def test_an_unsupported_denoiser_is_refused_before_weights_are_read(monkeypatch):
    monkeypatch.delitem(diffusion_pipelines.DENOISERS, "UNet2DConditionModel")
    with pytest.raises(NotImplementedError, match="UNet2DConditionModel.*no loader"):
        DiffusionPipeline.load(FIXTURES / "sd15")


def test_an_unsupported_scheduler_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setitem(diffusion_pipelines.DENOISERS, "FluxTransformer2DModel", lambda folder, **kw: folder)
    directory = copy_pipeline(tmp_path, "flux")
    edit_index(directory, scheduler=["diffusers", "FlowMatchHeunDiscreteScheduler"])
    with pytest.raises(NotImplementedError, match="FlowMatchHeunDiscreteScheduler; Dew has no rebuild"):
        DiffusionPipeline.load(directory)


# --- dew.pipeline and Pretrained.load -------------------------------------------------------------


def test_dew_pipeline_and_pretrained_load_route_a_pipeline_directory_to_its_loader(monkeypatch):
    import dew
    from dew.interop import Pretrained

    for name in ("UNet2DConditionModel", "FluxTransformer2DModel"):  # refused by the pipeline loader
        monkeypatch.delitem(diffusion_pipelines.DENOISERS, name)

    with pytest.raises(NotImplementedError, match="UNet2DConditionModel.*no loader"):
        dew.pipeline(FIXTURES / "sdxl")
    with pytest.raises(NotImplementedError, match="FluxTransformer2DModel.*no loader"):
        Pretrained.load(FIXTURES / "flux")
    with pytest.raises(ValueError, match="step=3 picks one of a saved run's checkpoints"):
        dew.pipeline(FIXTURES / "sd15", step=3)


def test_a_loaded_pipeline_serves_text_to_image_with_its_own_defaults(monkeypatch):
    """With a denoiser and a scheduler registered, dew.pipeline assembles the TextToImage: the
    family's prompt encoder as its condition, latents of the VAE's shape, SD3's 28 steps and 7.0 guidance."""
    import types

    import dew
    from dew.inference.image import TextToImage
    from dew.interop.autoencoders import PretrainedAutoencoder

    denoiser = types.SimpleNamespace(model="transformer-module", variables={"params": {}})
    scheduler = types.SimpleNamespace(process="flow-process", solver="euler")
    monkeypatch.setitem(diffusion_pipelines.DENOISERS, "SD3Transformer2DModel", lambda folder, **kw: denoiser)
    monkeypatch.setitem(diffusion_pipelines.SCHEDULERS, "FlowMatchEulerDiscreteScheduler", lambda config, **options: scheduler)
    task = dew.pipeline(FIXTURES / "sd3")
    assert isinstance(task, TextToImage) and isinstance(task.autoencoder, PretrainedAutoencoder)
    assert (task.model, task.process, task.solver) == ("transformer-module", "flow-process", "euler")
    assert isinstance(task.conditions["prompt"], SD3Prompts)
    assert task.sample_shape == (8, 8, 16) and task.steps == 28 and task.guidance.scale == 7.0


@pytest.mark.reference
@pytest.mark.parametrize("folder", ["sd15/tokenizer", "sdxl/tokenizer_2"])
def test_clip_tokenizer_files_match_transformers_on_varied_text(folder):
    """Unicode, digits, contractions, runs of whitespace and literal special tokens tokenize as
    transformers' CLIPTokenizer reads the same vocab.json + merges.txt."""
    import transformers

    texts = ["It's a DOG's  life\tand I'll see 1234!", "Ünïcödé café — naïve résumé", "<|endoftext|>a!b!!c",
             "   leading and trailing   ", "emoji 🌸 and ümlauts", "x" * 40, "the digit 7, drawn in ink"]
    theirs = transformers.CLIPTokenizer.from_pretrained(FIXTURES / folder)
    expected = theirs(texts, padding="max_length", max_length=16, truncation=True).input_ids
    with pytest.warns(UserWarning, match="cut to fit"):
        ours, _ = caption_tokens(FIXTURES / folder, 16)(texts)
    np.testing.assert_array_equal(ours, np.asarray(expected))
