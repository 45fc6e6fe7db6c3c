"""FluxTransformer against diffusers: fixtures written by tools/flux_transformer_fixtures.py (tiny
FLUX.1-dev and -schnell structures, called as FluxPipeline calls its transformer)."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from flax.core import meta

from dew.interop.flux_transformer import PretrainedFluxTransformer, diffusers_name, example_inputs, model_kwargs
from dew.interop.safetensors_io import DIFFUSERS_FILE, SafetensorsFile, save_file
from dew.interop.weight_map import expected_params
from dew.nn.backbones import flux_transformer
from dew.nn.backbones.flux_transformer import FluxTransformer
from hf_reference import ROOT, moved_variables

FIXTURES = ROOT / "tests/fixtures/flux_transformer"
TOLERANCE = 1e-4  # float32 outputs against diffusers'


def reference(name):
    return np.load(FIXTURES / name / "reference.npz")


def conditions_of(ref):
    conditions = {"encoder_hidden_states": jnp.asarray(ref["encoder_hidden_states"]),
                  "pooled_projections": jnp.asarray(ref["pooled_projections"])}
    if "guidance" in ref:
        conditions["guidance"] = jnp.asarray(ref["guidance"])
    return conditions


@pytest.fixture(scope="module")
def loaded():
    return {name: PretrainedFluxTransformer.load(FIXTURES / name) for name in ("dev", "schnell")}


@pytest.mark.parametrize("name", ["dev", "schnell"])
def test_outputs_match_diffusers(loaded, name):
    transformer, ref = loaded[name], reference(name)
    for timesteps, want in zip(ref["timesteps"], ref["outputs"]):
        got = transformer(jnp.asarray(ref["latents"]), jnp.asarray(timesteps), conditions_of(ref))
        assert got.shape == ref["latents"].shape
        np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)


def test_bfloat16_compute_stays_near_diffusers_float32():
    """dtype=bfloat16 computes in bf16 (rotary and qk-norm in float32): within 0.05 of float32 outputs of
    about 2 (measured 0.013), and bf16 latents give bf16 velocities."""
    transformer, ref = PretrainedFluxTransformer.load(FIXTURES / "dev", dtype=jnp.bfloat16), reference("dev")
    got = transformer(jnp.asarray(ref["latents"], jnp.bfloat16), jnp.asarray(ref["timesteps"][0]), conditions_of(ref))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), ref["outputs"][0], atol=0.05, rtol=0)


def test_config_is_read(loaded):
    dev, schnell = loaded["dev"].model, loaded["schnell"].model
    assert (dev.guidance_embeds, dev.num_layers, schnell.guidance_embeds, schnell.num_layers) == (True, 2, False, 1)
    assert dev.axes_dims_rope == (4, 6, 6) and dev.in_channels == 16 and dev.num_single_layers == 2
    params = loaded["dev"].variables["params"]
    assert "guidance_embedder" in params["time_text_embed"]
    assert "guidance_embedder" not in loaded["schnell"].variables["params"]["time_text_embed"]


# FLUX.1-dev's transformer/config.json as published
FLUX_DEV_CONFIG = {"_class_name": "FluxTransformer2DModel", "_diffusers_version": "0.30.0.dev0",
                   "attention_head_dim": 128, "guidance_embeds": True, "in_channels": 64, "joint_attention_dim": 4096,
                   "num_attention_heads": 24, "num_layers": 19, "num_single_layers": 38, "patch_size": 1,
                   "pooled_projection_dim": 768}


def flux_dev_params():
    model = FluxTransformer(**model_kwargs(FLUX_DEV_CONFIG, "FLUX.1-dev"))
    return expected_params(model, *example_inputs(model))


def test_the_released_dev_config_builds_the_released_size():
    """diffusers' FluxTransformer2DModel with this config (built on the meta device) holds 1160 tensors
    and 11,901,408,320 parameters; Dew's model traced without allocating holds the same."""
    params = flux_dev_params()
    assert len(params) == 1160
    assert sum(math.prod(spec.shape) for spec in params.values()) == 11_901_408_320


def _swapped_ids(rows, columns):
    ids = np.zeros((rows, columns, 3))
    ids[..., 1] = np.arange(columns)[None, :]  # the column where the row belongs, and back
    ids[..., 2] = np.arange(rows)[:, None]
    return ids.reshape(rows * columns, 3)


def _channels_last_pack(x):
    batch, height, width, channels = x.shape
    x = x.reshape(batch, height // 2, 2, width // 2, 2, channels).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(batch, (height // 2) * (width // 2), 4 * channels)


_COS_THEN_SIN = flux_transformer.sinusoidal_features


def _sin_before_cos(values, features=256, max_period=10000.0):
    return jnp.roll(_COS_THEN_SIN(values, features, max_period), features // 2, axis=-1)


MISTAKES = {
    # the image ids' row and column axes exchanged
    "swapped_ids_axes": ("image_ids", _swapped_ids),
    # rotating the two halves of a head (Llama's rotate_half) instead of adjacent pairs
    "half_split_rotation": ("rotate_pairs", lambda x: jnp.concatenate(
        [-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]], axis=-1)),
    # packing the 2x2 patch channels-last (row, column, channel) instead of diffusers' (channel, row, column)
    "channels_last_packing": ("pack_latents", _channels_last_pack),
    # the timestep sinusoid as sin then cos (flip_sin_to_cos=False)
    "sin_before_cos": ("sinusoidal_features", _sin_before_cos),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_realistic_mistake_breaks_parity(loaded, mistake, monkeypatch):
    """Negative control: each convention the parity test relies on, got wrong, moves the outputs far."""
    transformer, ref = loaded["dev"], reference("dev")
    attribute, wrong = MISTAKES[mistake]
    monkeypatch.setattr(flux_transformer, attribute, wrong)
    # op by op (no jit), so the patched function is the one that runs
    got = transformer.model.apply(transformer.variables, jnp.asarray(ref["latents"]), jnp.asarray(ref["timesteps"][0]),
                                  conditions_of(ref))
    assert np.abs(np.asarray(got) - ref["outputs"][0]).max() > 100 * TOLERANCE


def test_guidance_and_text_change_the_output(loaded):
    transformer, ref = loaded["dev"], reference("dev")
    x, t = jnp.asarray(ref["latents"]), jnp.asarray(ref["timesteps"][0])
    base = np.asarray(transformer(x, t, conditions_of(ref)))
    other_guidance = np.asarray(transformer(x, t, {**conditions_of(ref), "guidance": jnp.asarray([1.0, 1.0])}))
    other_text = np.asarray(transformer(x, t, {**conditions_of(ref), "encoder_hidden_states":
                                               jnp.asarray(ref["encoder_hidden_states"][::-1])}))
    assert np.abs(base - other_guidance).max() > 100 * TOLERANCE
    assert np.abs(base[0] - other_text[0]).max() > 100 * TOLERANCE


def _same_params(a, b):
    flat_a, flat_b = traverse_util.flatten_dict(a), traverse_util.flatten_dict(b)
    assert sorted(flat_a) == sorted(flat_b)
    for path in flat_a:
        np.testing.assert_array_equal(np.asarray(flat_a[path]), np.asarray(flat_b[path]), err_msg="/".join(path))


def test_save_then_load_round_trips_bitwise(loaded, tmp_path):
    transformer, ref = loaded["dev"], reference("dev")
    transformer.save(tmp_path / "transformer")
    assert sorted(p.name for p in (tmp_path / "transformer").iterdir()) == ["config.json", DIFFUSERS_FILE]
    again = PretrainedFluxTransformer.load(tmp_path / "transformer")
    assert again.model == transformer.model
    _same_params(again.variables["params"], transformer.variables["params"])
    x, t = jnp.asarray(ref["latents"]), jnp.asarray(ref["timesteps"][1])
    np.testing.assert_array_equal(again(x, t, conditions_of(ref)), transformer(x, t, conditions_of(ref)))
    # the same tensor names and bytes as the diffusers file it was loaded from
    ours, theirs = SafetensorsFile(tmp_path / "transformer" / DIFFUSERS_FILE), SafetensorsFile(FIXTURES / "dev" / DIFFUSERS_FILE)
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        transformer.save(tmp_path / "transformer")


def test_sharded_weights_load_like_one_file(loaded, tmp_path):
    """FLUX.1-dev's transformer ships as shards listed by diffusion_pytorch_model.safetensors.index.json."""
    single = SafetensorsFile(FIXTURES / "schnell" / DIFFUSERS_FILE)
    names = sorted(single)
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[: len(names) // 2],
              "diffusion_pytorch_model-00002-of-00002.safetensors": names[len(names) // 2:]}
    directory = tmp_path / "sharded"
    directory.mkdir()
    shutil.copyfile(FIXTURES / "schnell" / "config.json", directory / "config.json")
    for shard, members in shards.items():
        save_file({name: single[name] for name in members}, directory / shard)
    index = {"metadata": {}, "weight_map": {name: shard for shard, members in shards.items() for name in members}}
    (directory / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    _same_params(PretrainedFluxTransformer.load(directory).variables["params"], loaded["schnell"].variables["params"])


def test_a_model_made_in_dew_saves_for_diffusers(tmp_path):
    model = FluxTransformer(in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
                            num_attention_heads=2, joint_attention_dim=12, pooled_projection_dim=6,
                            guidance_embeds=True, axes_dims_rope=(2, 2, 4))
    x = jax.random.normal(jax.random.key(0), (2, 4, 6, 2))
    conditions = {"encoder_hidden_states": jnp.ones((2, 3, 12)), "pooled_projections": jnp.ones((2, 6)),
                  "guidance": jnp.full((2,), 3.5)}
    shapes = meta.unbox(jax.eval_shape(model.init, jax.random.key(1), x, jnp.full((2,), 0.5), conditions))
    rng = np.random.default_rng(0)  # weights as training leaves them: off the zero-initialized gates
    variables = jax.tree.map(lambda leaf: jnp.asarray(0.2 * rng.standard_normal(leaf.shape), leaf.dtype), shapes)
    bundle = PretrainedFluxTransformer.from_model(model, variables)
    bundle.save(tmp_path / "mine")
    config = json.loads((tmp_path / "mine" / "config.json").read_text())
    assert config["_class_name"] == "FluxTransformer2DModel" and config["axes_dims_rope"] == [2, 2, 4]
    again = PretrainedFluxTransformer.load(tmp_path / "mine")
    np.testing.assert_array_equal(again(x, jnp.full((2,), 0.5), conditions), bundle(x, jnp.full((2,), 0.5), conditions))
    names = {diffusers_name(path) for path in traverse_util.flatten_dict(variables["params"])}
    assert {"transformer_blocks.0.ff.net.0.proj.weight", "transformer_blocks.0.attn.to_out.0.bias",
            "single_transformer_blocks.0.attn.norm_k.weight", "norm_out.linear.weight"} <= names
    with pytest.raises(ValueError, match="missing params"):
        PretrainedFluxTransformer.from_model(model.clone(num_single_layers=2), variables).save(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_bad_input_is_refused_with_the_fix(loaded):
    dev, schnell, ref = loaded["dev"], loaded["schnell"], reference("dev")
    x, t, conditions = jnp.asarray(ref["latents"]), jnp.asarray(ref["timesteps"][0]), conditions_of(ref)
    with pytest.raises(ValueError, match="even height and width"):
        dev(x[:, :7], t, conditions)
    with pytest.raises(ValueError, match="in_channels=16 takes 4"):
        dev(jnp.zeros((2, 8, 12, 16)), t, conditions)
    with pytest.raises(ValueError, match="needs condition 'guidance'"):
        dev(x, t, {k: v for k, v in conditions.items() if k != "guidance"})
    with pytest.raises(ValueError, match="guidance_embeds=False"):
        schnell(x, t, conditions)
    with pytest.raises(ValueError, match="needs condition 'pooled_projections'"):
        dev(x, t, {k: v for k, v in conditions.items() if k != "pooled_projections"})
    with pytest.raises(ValueError, match=r"'encoder_hidden_states' must be \[2, tokens, 32\]"):
        dev(x, t, {**conditions, "encoder_hidden_states": jnp.zeros((2, 5, 16))})
    with pytest.raises(ValueError, match=r"timesteps must be \[2\]"):
        dev(x, jnp.zeros((3,)), conditions)
    with pytest.raises(ValueError, match="axes_dims_rope"):
        dev.model.clone(axes_dims_rope=(4, 6, 8)).apply(dev.variables, x, t, conditions)


@pytest.mark.parametrize("change, message", [
    ({"patch_size": 2}, "patch_size=2"),
    ({"qk_norm": "layer_norm"}, "qk_norm='layer_norm'"),
    ({"_class_name": "SD3Transformer2DModel"}, "not a FluxTransformer2DModel"),
    ({"num_single_layers": 3}, "missing tensors"),
])
def test_a_config_dew_cannot_honour_is_refused(tmp_path, change, message):
    directory = tmp_path / "transformer"
    shutil.copytree(FIXTURES / "schnell", directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        PretrainedFluxTransformer.load(directory)


def test_a_missing_directory_names_the_transformer_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="transformer/ folder"):
        PretrainedFluxTransformer.load(tmp_path)


@pytest.mark.reference
def test_diffusers_reads_what_dew_saves(loaded, tmp_path):
    pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    spec = importlib.util.spec_from_file_location("flux_fixtures", ROOT / "tools/flux_transformer_fixtures.py")
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    transformer, ref = loaded["dev"], reference("dev")
    moved = PretrainedFluxTransformer(transformer.model, moved_variables(transformer), transformer.config)
    moved.save(tmp_path / "transformer")
    theirs = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "transformer").eval()
    for timesteps, recorded in zip(ref["timesteps"], ref["outputs"]):
        want = fixtures.pipeline_call(theirs, ref["latents"], ref["encoder_hidden_states"], ref["pooled_projections"],
                                      timesteps, ref["guidance"])
        got = moved(jnp.asarray(ref["latents"]), jnp.asarray(timesteps), conditions_of(ref))
        np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)
        assert np.abs(want - recorded).max() > 100 * TOLERANCE  # the moved weights are not the fixture's


@pytest.mark.reference
def test_every_released_tensor_has_its_param():
    """At FLUX.1-dev's full size, Dew's param names and shapes are diffusers' tensor names and shapes."""
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    with torch.device("meta"):
        theirs = diffusers.FluxTransformer2DModel(**{k: v for k, v in FLUX_DEV_CONFIG.items() if not k.startswith("_")})
    want = {name: list(tensor.shape) for name, tensor in theirs.state_dict().items()}
    ours = {}
    for path, spec in flux_dev_params().items():
        shape = list(spec.shape)
        ours[diffusers_name(path)] = shape[::-1] if path[-1] == "kernel" else shape  # torch's [out, in]
    assert ours == want
