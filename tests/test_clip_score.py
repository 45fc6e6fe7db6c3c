"""CLIP's image tower and CLIPScore against transformers: fixtures from tools/clip_score_fixtures.py."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dew.eval.clip_score import CLIPScore, clip_pixels
from dew.eval.evaluation import Evaluation
from dew.interop.clip import PretrainedCLIP
from dew.nn.text_encoders.clip import layer_norm

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "clip"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(FIXTURE / "reference.npz"))


@pytest.fixture(scope="module")
def clip():
    return PretrainedCLIP.load(FIXTURE)


@pytest.fixture(scope="module")
def metric(clip):
    return CLIPScore(clip)


def all_pixels(reference):
    return np.concatenate([reference["pixels_a"], reference["pixels_b"]])


def close(actual, expected, tolerance=TOLERANCE):
    np.testing.assert_allclose(np.asarray(actual), expected, atol=tolerance, rtol=0)


def test_both_towers_and_the_logit_scale_load(clip, reference):
    out = clip.encode_pixels(all_pixels(reference))
    close(out.pooled, reference["pooled_image"])
    close(out.projected, reference["image_embeds"])
    text = clip.text.model.apply(clip.text.variables, jnp.asarray(reference["input_ids"]))
    close(text.projected, reference["text_embeds"])
    unit = lambda x: np.asarray(x) / np.linalg.norm(np.asarray(x), axis=-1, keepdims=True)  # noqa: E731
    logits = np.exp(clip.logit_scale) * unit(out.projected) @ unit(text.projected).T
    close(logits, reference["logits_per_image"], 1e-3)


def test_prompts_tokenize_as_transformers_does(clip, reference):
    ids, _ = clip.text.tokens(list(reference["prompts"]))
    np.testing.assert_array_equal(ids, reference["input_ids"])


@pytest.mark.parametrize("part", ["a", "b"])
def test_preprocessing_matches_clips_processor(reference, part):
    """Shrinking (40x48, cropped) and growing (24x24) images both land on transformers' pixels."""
    close(clip_pixels(reference[f"images_{part}"], 32), reference[f"pixels_{part}"])


def test_wrong_normalization_breaks_preprocessing_parity(reference):
    """Negative control: ImageNet's mean and std instead of CLIP's."""
    wrong = clip_pixels(reference["images_a"], 32, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    assert np.abs(np.asarray(wrong) - reference["pixels_a"]).max() > 100 * TOLERANCE


def test_without_the_class_token_the_features_differ(clip, reference):
    """Negative control: pooling the first patch instead of the class token."""
    pixels = jnp.asarray(all_pixels(reference))
    vision = clip.vision
    params = clip.vision_variables["params"]
    embedded = vision.apply(clip.vision_variables, pixels).last  # states after the blocks
    post = {"params": params["post_layernorm"]}
    norm = layer_norm(vision.layer_norm_eps, "post_layernorm", dtype=jnp.float32, param_dtype=jnp.float32)
    first_patch = norm.apply(post, embedded[:, 1])
    assert np.abs(np.asarray(first_patch) - reference["pooled_image"]).max() > 100 * TOLERANCE
    close(norm.apply(post, embedded[:, 0]), reference["pooled_image"])  # the class token is what pools


def test_the_score_is_transformers_per_pair_and_over_the_pass(metric, reference):
    prompts = list(reference["prompts"])
    images = [reference["images_a"], reference["images_b"]]
    scores = np.concatenate([metric.scores(images[0], prompts[:4]), metric.scores(images[1], prompts[4:])])
    close(scores, reference["scores"])
    assert (reference["scores"] == 0).any() and (reference["scores"] > 1).any()  # the clamp is exercised
    accumulator = metric.empty()
    for batch, texts in ((images[0], prompts[:4]), (images[1], prompts[4:])):
        accumulator = metric.update(accumulator, {"samples": batch, "caption": np.asarray(texts)})
    close(metric.result(accumulator)["clip_score"], reference["clip_score"])
    # the pass's score is over all pairs, not the mean of the two batches' means
    batch_means = np.mean([metric(images[0], prompts[:4]), metric(images[1], prompts[4:])])
    assert abs(batch_means - float(reference["clip_score"])) > 100 * TOLERANCE


def test_wrong_normalization_changes_the_score(clip, reference):
    wrong = CLIPScore(clip, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    scores = wrong.scores(reference["images_a"], list(reference["prompts"][:4]))
    assert np.abs(scores - reference["scores"][:4]).max() > 100 * TOLERANCE


def test_uint8_images_score_as_their_float_range(metric, reference):
    images = reference["images_a"]
    as_uint8 = np.round((images + 1.0) * 127.5).astype(np.uint8)
    prompts = list(reference["prompts"][:4])
    close(metric.scores(as_uint8, prompts), metric.scores(as_uint8.astype(np.float32) / 127.5 - 1.0, prompts))


def test_a_directory_loads_and_bad_inputs_fail_early(tmp_path, reference):
    metric = CLIPScore(str(FIXTURE))
    close(metric.scores(reference["images_b"], list(reference["prompts"][4:])), reference["scores"][4:])
    with pytest.raises(ValueError, match="2 images and 1 prompts"):
        metric.scores(reference["images_b"], ["one"])
    with pytest.raises(KeyError, match="'caption'"):
        metric.update(metric.empty(), {"samples": reference["images_b"]})
    with pytest.raises(ValueError, match="TextCondition"):
        metric.update(metric.empty(), {"samples": reference["images_b"], "caption": reference["input_ids"][:2]})
    with pytest.raises(ValueError, match="RGB images"):
        clip_pixels(np.zeros((2, 8, 8, 1), np.float32), 32)
    vision_only = tmp_path / "vision"  # a CLIPVisionModel: the image tower's tensors alone
    vision_only.mkdir()
    config = json.loads((FIXTURE / "config.json").read_text())
    (vision_only / "config.json").write_text(json.dumps({**config["vision_config"], "model_type": "clip_vision_model"}))
    tensors = load_file(FIXTURE / "model.safetensors")
    save_file({name: array for name, array in tensors.items() if name.startswith("vision_model.")},
              vision_only / "model.safetensors")
    loaded = PretrainedCLIP.load(vision_only)
    assert loaded.text is None and loaded.vision.projection_dim is None
    close(loaded.encode_pixels(all_pixels(reference)).pooled, reference["pooled_image"])
    with pytest.raises(ValueError, match="both towers"):
        CLIPScore(loaded)


class CaptionedSamples:
    """An objective whose evaluate returns the batch's images as samples with their caption ids, as a
    text-to-image objective does when it draws samples."""

    def evaluate(self, variables, batch, step):
        return {"samples": batch["image"], "caption": batch["caption"]}


def test_a_validation_pass_scores_decoded_caption_ids(clip, metric, reference):
    """Token ids in the outputs are read back through the tokenizer that made them."""
    from dew.data.caption_tokens import CaptionTokens

    tokens = CaptionTokens(clip.text.tokens.tokenizer, 16)
    prompts = list(reference["prompts"])
    batches = [{"image": reference["images_a"], "caption": tokens(prompts[:4])[0]},
               {"image": reference["images_b"], "caption": tokens(prompts[4:])[0]}]
    scoring = CLIPScore(clip, captions=tokens)
    result = Evaluation.run(CaptionedSamples(), {}, lambda partition: iter(batches), metrics=[scoring],
                            key=jax.random.key(0))
    close(result.scores["val/clip_score"], reference["clip_score"])


class Recorder:
    """A metric that keeps the outputs it sees (to compare the pass's score with a direct call)."""

    name = "recorder"

    def __init__(self):
        self.seen = []

    def empty(self):
        return None

    def update(self, accumulator, outputs):
        self.seen.append(dict(outputs))
        return accumulator

    def result(self, accumulator):
        return {}


def text_to_image():
    """A tiny MMDiT conditioned by the fixture CLIPModel's text tower, drawing samples in evaluate."""
    from dew.diffusion.presets import Flow
    from dew.interop.text_encoders import PretrainedTextEncoder
    from dew.nn.backbones.mmdit import MMDiT
    from dew.objectives.base import Field, InputSpec
    from dew.objectives.diffusion import DiffusionObjective
    from dew.objectives.text_condition import TextCondition

    condition = TextCondition(PretrainedTextEncoder.load(FIXTURE))
    model = MMDiT(patch_size=2, emb_features=32, num_layers=1, num_heads=2, text_features=32)
    inputs = InputSpec(Field("image", (8, 8, 3)), conditions={"caption": condition})
    return condition, DiffusionObjective(model, Flow(), inputs, evaluation_steps=2)


def test_a_text_to_image_evaluate_returns_its_caption_ids_beside_the_samples():
    from dew.objectives.base import Step

    condition, objective = text_to_image()
    variables = jax.eval_shape(objective.init, jax.random.key(0))
    batch = {"image": jax.ShapeDtypeStruct((2, 8, 8, 3), jnp.uint8),
             "caption": jax.ShapeDtypeStruct((2, 16), jnp.int32)}
    outputs = jax.eval_shape(lambda v, b: objective.evaluate(v, b, Step(step=0, key=jax.random.key(0))), variables, batch)
    assert outputs["caption"].shape == (2, 16) and outputs["samples"].shape == (2, 8, 8, 3)


@pytest.mark.slow
def test_fit_scores_a_text_to_image_runs_samples_against_its_captions(clip):
    import optax

    from dew.data.dataset import Dataset
    from dew.training.trainer import Trainer

    condition, objective = text_to_image()
    images = np.random.default_rng(0).integers(0, 256, (16, 8, 8, 3), dtype=np.uint8)
    captions = ["a handwritten seven", "a photo of a cat", "a photo of a dog", "the digit 3"] * 4
    ids = condition.tokenize(captions)
    data = Dataset.from_records({"image": images[:8], "caption": ids[:8]}, batch=8,
                               validation={"image": images[8:], "caption": ids[8:]})
    trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0))
    recorder = Recorder()
    scoring = CLIPScore(clip, captions=condition)
    trainer.fit(data, steps=1, log_every=1, eval_every=1, metrics=(scoring, recorder))
    score = trainer.evaluations[-1].scores["val/clip_score"]
    (outputs,) = recorder.seen
    np.testing.assert_array_equal(outputs["caption"], ids[8:])  # the run hands its caption ids to metrics
    close(score, scoring(outputs["samples"], captions[8:]))
    assert np.isfinite(score) and 0.0 <= score <= 100.0
