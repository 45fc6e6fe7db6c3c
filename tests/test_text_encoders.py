"""CLIP and T5 text encoders against transformers: fixtures from tools/text_encoder_fixtures.py."""

from __future__ import annotations

import json
import pathlib
import shutil
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from dew.data.caption_tokens import CaptionTokens
from dew.interop.text_encoders import PretrainedTextEncoder
from dew.nn.text_encoders.t5 import relative_position_buckets

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "text_encoders"
TOLERANCE = 1e-4
CAPTIONS = [  # as tools/text_encoder_fixtures.py
    "a handwritten seven",
    "The digit 7, drawn in ink!",
    "a photograph of a red flower with long petals beside a small grey stone in the morning light",
]


def reference(name):
    return np.load(FIXTURES / name / "reference.npz")


@pytest.fixture(scope="module")
def loaded():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the long caption is cut, as transformers cuts it
        return {name: PretrainedTextEncoder.load(FIXTURES / name) for name in ("clip", "clip-gelu", "t5", "t5-relu")}


def close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("name", ["clip", "clip-gelu", "t5", "t5-relu"])
def test_captions_tokenize_as_transformers_does(loaded, name):
    ref = reference(name)
    with pytest.warns(UserWarning, match="1 caption.*cut to fit"):
        ids, mask = loaded[name].tokens(CAPTIONS)
    np.testing.assert_array_equal(ids, ref["input_ids"])
    np.testing.assert_array_equal(mask, ref["attention_mask"])


@pytest.mark.parametrize("name", ["clip", "clip-gelu"])
def test_clip_outputs_match_transformers(loaded, name):
    encoder, ref = loaded[name], reference(name)
    ids = jnp.asarray(ref["input_ids"])
    out = encoder.model.apply(encoder.variables, ids)
    close(out.last, ref["last"])
    close(out.penultimate, ref["penultimate"])
    close(out.pooled, ref["pooled"])
    close(out.projected, ref["projected"])
    masked = encoder.model.apply(encoder.variables, ids, jnp.asarray(ref["attention_mask"]))
    close(masked.last, ref["masked_last"])


@pytest.mark.parametrize("name", ["t5", "t5-relu"])
def test_t5_outputs_match_transformers(loaded, name):
    encoder, ref = loaded[name], reference(name)
    ids = jnp.asarray(ref["input_ids"])
    close(encoder.model.apply(encoder.variables, ids), ref["last"])
    close(encoder.model.apply(encoder.variables, ids, jnp.asarray(ref["attention_mask"])), ref["masked_last"])


def test_captions_encode_end_to_end(loaded):
    with pytest.warns(UserWarning):
        out = loaded["clip"](CAPTIONS)
    close(out.pooled, reference("clip")["pooled"])
    with pytest.warns(UserWarning):
        close(loaded["t5"](CAPTIONS, masked=True), reference("t5")["masked_last"])


@pytest.mark.parametrize("change", ["activation", "pooling", "layer_norm_eps"])
def test_a_wrong_clip_setting_breaks_parity(loaded, change):
    """Negative controls: the activation, the pooling rule and the norm epsilon each show."""
    encoder, ref = loaded["clip"], reference("clip")
    wrong = {"activation": dict(hidden_act="gelu"), "pooling": dict(eos_token_id=2),
             "layer_norm_eps": dict(layer_norm_eps=1.0)}[change]
    out = encoder.model.clone(**wrong).apply(encoder.variables, jnp.asarray(ref["input_ids"]))
    assert np.abs(np.asarray(out.pooled) - ref["pooled"]).max() > 100 * TOLERANCE


@pytest.mark.parametrize("change", ["buckets", "max_distance", "gating"])
def test_a_wrong_t5_setting_breaks_parity(loaded, change):
    encoder, ref = loaded["t5"], reference("t5")
    if change == "gating":
        encoder, ref = loaded["t5-relu"], reference("t5-relu")
    wrong = {"buckets": dict(relative_attention_num_buckets=6), "max_distance": dict(relative_attention_max_distance=64),
             "gating": dict(act="gelu_new")}[change]
    model = encoder.model.clone(**wrong)
    variables = encoder.variables
    if change == "buckets":  # the same table read with a different bucketing
        params = dict(variables["params"])
        params["relative_attention_bias"] = {"embedding": params["relative_attention_bias"]["embedding"][:6]}
        variables = {"params": params}
    last = model.apply(variables, jnp.asarray(ref["input_ids"]))
    assert np.abs(np.asarray(last) - ref["last"]).max() > 100 * TOLERANCE


def test_relative_buckets_follow_t5s_rule():
    """Bidirectional buckets for 32 buckets, max distance 128, as T5's published table."""
    buckets = np.asarray(relative_position_buckets(200, 32, 128))
    row = buckets[0]  # keys after query 0: distances 0..199 in the upper half (16..31)
    assert row[0] == 0 and list(row[1:8]) == list(range(17, 24))  # exact below 8
    assert row[8] == 24 and row[11] == 24 and row[12] == 25 and row[127] == 31 and row[199] == 31
    column = buckets[:, 0]  # keys before the query: the lower half (0..15)
    assert list(column[1:8]) == list(range(1, 8)) and column[199] == 15


@pytest.mark.parametrize("projection, act, gated", [
    ("relu", "relu", False), ("gelu", "gelu", False), ("gated-gelu", "gelu_new", True),
    ("gated-silu", "silu", True), ("gated-gelu_new", "gelu_new", True)])
def test_t5_feed_forward_names_read_as_transformers_reads_them(projection, act, gated):
    from dew.interop.text_encoders import t5_config, t5_kwargs
    from dew.nn.text_encoders.t5 import T5Encoder

    kwargs = t5_kwargs({"feed_forward_proj": projection})
    assert (kwargs["act"], kwargs["gated"]) == (act, gated)
    assert t5_kwargs(t5_config(T5Encoder(**kwargs), None)) == kwargs  # a save reads back the same
    assert kwargs["d_model"] == 512 and kwargs["relative_attention_num_buckets"] == 32  # T5Config's defaults


def test_save_then_load_gives_the_same_outputs(loaded, tmp_path):
    for name in ("clip", "t5"):
        encoder, ref = loaded[name], reference(name)
        encoder.save(tmp_path / name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            again = PretrainedTextEncoder.load(tmp_path / name)
        assert again.model == encoder.model
        assert again.tokens.max_length == encoder.tokens.max_length
        ids = jnp.asarray(ref["input_ids"])
        first, second = (e.model.apply(e.variables, ids) for e in (encoder, again))
        if name == "clip":
            first, second = first.last, second.last
        np.testing.assert_array_equal(np.asarray(first), np.asarray(second))


def test_bad_input_is_refused_with_the_fix(loaded, tmp_path):
    strict = CaptionTokens(FIXTURES / "clip", 16, truncate=False)
    with pytest.raises(ValueError, match="need more than max_length=16 tokens"):
        strict(CAPTIONS)
    with pytest.raises(TypeError, match="sequence of strings"):
        strict("one caption")
    encoder = loaded["clip"]
    with pytest.raises(ValueError, match="exceed max_position_embeddings=16"):
        encoder.model.apply(encoder.variables, jnp.zeros((1, 20), jnp.int32))

    other = tmp_path / "bert"
    shutil.copytree(FIXTURES / "clip", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type='bert'"):
        PretrainedTextEncoder.load(other)
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="unexpected tensors"):
        PretrainedTextEncoder.load(other)


def test_buffers_and_the_image_tower_of_a_released_checkpoint_are_skipped(tmp_path):
    """SD 1.x's text encoder carries a position_ids buffer; a CLIPModel also its image tower."""
    from dew.interop.safetensors_io import SafetensorsFile, save_file

    target = tmp_path / "released"
    shutil.copytree(FIXTURES / "clip", target)
    tensors = dict(SafetensorsFile(FIXTURES / "clip" / "model.safetensors").items())
    tensors["text_model.embeddings.position_ids"] = np.arange(16, dtype=np.int64)[None]
    tensors["vision_model.post_layernorm.weight"] = np.ones(8, np.float32)
    tensors["logit_scale"] = np.zeros((), np.float32)
    save_file(tensors, target / "model.safetensors")
    ref = reference("clip")
    text_config = json.loads((target / "config.json").read_text())
    for config in (text_config, {"model_type": "clip", "projection_dim": 24, "text_config": text_config}):
        (target / "config.json").write_text(json.dumps(config))
        encoder = PretrainedTextEncoder.load(target)
        close(encoder.model.apply(encoder.variables, jnp.asarray(ref["input_ids"])).projected, ref["projected"])


def test_a_clip_text_model_saved_without_the_text_model_prefix_loads(tmp_path):
    """transformers 5 saves CLIPTextModel's weights as "embeddings...", "encoder...", "final_layer_norm..."
    (older versions, and CLIPTextModelWithProjection, prefix them with "text_model.")."""
    from dew.interop.safetensors_io import SafetensorsFile, save_file

    target = tmp_path / "unprefixed"
    shutil.copytree(FIXTURES / "clip", target)
    tensors = {name.removeprefix("text_model."): value
               for name, value in SafetensorsFile(FIXTURES / "clip" / "model.safetensors").items()}
    assert "embeddings.token_embedding.weight" in tensors and "text_projection.weight" in tensors
    save_file(tensors, target / "model.safetensors")
    ref = reference("clip")
    encoder = PretrainedTextEncoder.load(target)
    out = encoder.model.apply(encoder.variables, jnp.asarray(ref["input_ids"]))
    close(out.last, ref["last"])
    close(out.projected, ref["projected"])
    # negative control: a prefix on some tensors and not on others is still refused
    tensors["text_model.final_layer_norm.weight"] = tensors.pop("final_layer_norm.weight")
    save_file(tensors, target / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensors"):
        PretrainedTextEncoder.load(target)


@pytest.mark.reference
def test_transformers_reads_what_dew_saves(loaded, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for name, cls in (("clip", transformers.CLIPTextModelWithProjection), ("t5", transformers.T5EncoderModel)):
        ref = reference(name)
        loaded[name].save(tmp_path / name)
        theirs = cls.from_pretrained(tmp_path / name).eval()
        with torch.no_grad():
            out = theirs(input_ids=torch.from_numpy(ref["input_ids"].astype(np.int64)))
        close(out.last_hidden_state.numpy(), ref["last"])
        if name == "clip":
            close(out.text_embeds.numpy(), ref["projected"])
        tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / name)
        ids = tokenizer(CAPTIONS, padding="max_length", max_length=ref["input_ids"].shape[1], truncation=True)["input_ids"]
        np.testing.assert_array_equal(np.asarray(ids), ref["input_ids"])
