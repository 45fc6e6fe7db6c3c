"""SD3Transformer against diffusers' SD3Transformer2DModel: fixtures from tools/sd3_transformer_fixtures.py.

"sd3" has SD3-medium's structure, "sd35" SD3.5-medium's (q/k RMSNorm, an image-only attention in
block 0), both tiny and random. Each records two latents at two timestep vectors, square (8 x 8)
and wide (8 x 12, a 4 x 6 token grid cropped off-centre from the 8 x 8 position table).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

import dew.nn.backbones.sd3_transformer as sd3_module
from dew.interop.safetensors_io import DIFFUSERS_FILE, DIFFUSERS_INDEX, SafetensorsFile, save_file
from dew.interop.sd3_transformer import PretrainedSD3Transformer, example_inputs
from dew.nn.backbones.sd3_transformer import SD3Transformer

FIXTURES = Path(__file__).parent / "fixtures" / "sd3_transformer"
TOLERANCE = 1e-4  # float32 outputs against diffusers' (they agree to about 1e-6)
NAMES = ("sd3", "sd35")


def reference(name):
    return np.load(FIXTURES / name / "reference.npz")


def inputs(ref, prefix=""):
    conditions = {key: jnp.asarray(ref[prefix + key]) for key in ("encoder_hidden_states", "pooled_projections")}
    return jnp.asarray(ref[prefix + "latents"]), conditions


@pytest.fixture(scope="module")
def loaded():
    return {name: PretrainedSD3Transformer.load(FIXTURES / name) for name in NAMES}


def outputs(model, variables, ref, prefix=""):
    """[calls, B, H, W, C] for each recorded timestep vector, through a fresh trace of ``model``."""
    apply = jax.jit(model.apply)
    x, conditions = inputs(ref, prefix)
    return np.stack([np.asarray(apply(variables, x, jnp.asarray(t), conditions)) for t in ref["timesteps"]])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("prefix", ["", "wide_"])
def test_outputs_match_diffusers(loaded, name, prefix):
    bundle, ref = loaded[name], reference(name)
    x, conditions = inputs(ref, prefix)
    for timesteps, expected in zip(ref["timesteps"], ref[prefix + "outputs"]):
        got = bundle(x, timesteps, conditions)
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=TOLERANCE, rtol=0)


def test_bfloat16_compute_stays_near_diffusers_float32():
    ref = reference("sd35")
    bundle = PretrainedSD3Transformer.load(FIXTURES / "sd35", dtype=jnp.bfloat16)
    x, conditions = inputs(ref)
    error = np.abs(np.asarray(bundle(x, ref["timesteps"][0], conditions)) - ref["outputs"][0]).max()
    assert 1e-4 < error < 0.05  # bfloat16 rounding shows, and stays small against outputs of about 1


def test_config_settings_are_read(loaded):
    sd3, sd35 = loaded["sd3"].model, loaded["sd35"].model
    assert (sd3.num_layers, sd3.num_attention_heads, sd3.qk_norm, sd3.dual_attention_layers) == (2, 4, None, ())
    assert (sd35.num_layers, sd35.num_attention_heads, sd35.qk_norm) == (3, 2, "rms_norm")
    assert sd35.dual_attention_layers == (0,)
    assert (sd35.sample_size, sd35.pos_embed_max_size, sd35.joint_attention_dim) == (8, 16, 32)
    params = loaded["sd35"].variables["params"]
    assert "attn2" in params["transformer_blocks_0"] and "attn2" not in params["transformer_blocks_1"]
    assert "to_add_out" not in params["transformer_blocks_2"]["attn"]  # the last block's text stream ends
    assert "ff_context" not in params["transformer_blocks_2"]


def _swap_halves(values):
    """The last axis's two halves exchanged (NumPy or traced JAX arrays)."""
    half = values.shape[-1] // 2
    xp = np if isinstance(values, np.ndarray) else jnp
    return xp.concatenate([values[..., half:], values[..., :half]], axis=-1)


def _patched(name, replacement):
    """A mistake made by replacing a helper of the model's module; the model itself is unchanged."""
    def apply(monkeypatch, model):
        original = getattr(sd3_module, name)
        monkeypatch.setattr(sd3_module, name, lambda *args: replacement(original, *args))
        return model
    return apply


MISTAKES = {
    # sin before cos in the timestep sinusoid (flip_sin_to_cos ignored)
    "timestep_sin_cos_order": _patched(
        "sinusoidal_features", lambda original, *args: _swap_halves(original(*args))),
    # the position table's column and row halves exchanged
    "position_rows_and_columns": _patched(
        "cropped_positions", lambda original, *args: _swap_halves(original(*args))),
    # the crop taken at the table's corner instead of its centre
    "position_crop_at_the_corner": _patched(
        "cropped_positions",
        lambda original, features, size, base, grid: sd3_module.grid_positions(features, size, base, 0, 0, *grid)),
    # positions spread as if trained at another latent size (sample_size sets their scale)
    "position_scale": lambda monkeypatch, model: model.clone(sample_size=2 * model.sample_size),
    # the same width split into twice the heads
    "head_split": lambda monkeypatch, model: model.clone(
        num_attention_heads=2 * model.num_attention_heads, attention_head_dim=model.attention_head_dim // 2),
    # q/k RMSNorm left out (its weights are loaded but unused)
    "no_qk_norm": lambda monkeypatch, model: model.clone(qk_norm=None),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_realistic_mistake_breaks_parity(loaded, monkeypatch, mistake):
    """Negative control: each mistake moves the outputs far beyond the tolerance."""
    name = "sd35" if mistake == "no_qk_norm" else "sd3"  # sd3 has no q/k norm, so any head split fits its weights
    bundle, ref = loaded[name], reference(name)
    model = MISTAKES[mistake](monkeypatch, bundle.model)
    assert np.abs(outputs(model, bundle.variables, ref, "wide_") - ref["wide_outputs"]).max() > 100 * TOLERANCE


# the structure settings of the released transformer/config.json files, and what diffusers 0.42.1
# counts for a model built from each (parameters, and state_dict tensors with pos_embed.pos_embed)
RELEASED = {
    "sd3-medium": (dict(num_layers=24, num_attention_heads=24, pos_embed_max_size=192), 2_028_328_000, 683),
    "sd3.5-large": (dict(num_layers=38, num_attention_heads=38, pos_embed_max_size=192, qk_norm="rms_norm"),
                    8_056_627_520, 1227),
    "sd3.5-medium": (dict(num_layers=24, num_attention_heads=24, pos_embed_max_size=384, qk_norm="rms_norm",
                          dual_attention_layers=tuple(range(13))), 2_243_171_520, 909),
}


def released_model(name):
    settings, _, _ = RELEASED[name]
    return SD3Transformer(sample_size=128, attention_head_dim=64, joint_attention_dim=4096,
                          pooled_projection_dim=2048, **settings)


@pytest.mark.parametrize("name", ["sd3-medium", "sd3.5-medium"])
def test_released_structures_have_diffusers_parameter_counts(name):
    from dew.interop.weight_map import expected_params

    model = released_model(name)
    _, parameters, tensors = RELEASED[name]
    expected = expected_params(model, *example_inputs(model))
    assert sum(int(np.prod(spec.shape)) for spec in expected.values()) == parameters
    assert len(expected) + 1 == tensors  # and the position table


def test_position_table_is_the_one_diffusers_saves(loaded):
    for name in NAMES:
        model = loaded[name].model
        stored = SafetensorsFile(FIXTURES / name / DIFFUSERS_FILE)["pos_embed.pos_embed"][0]
        base = model.sample_size // model.patch_size
        table = sd3_module.position_table(model.inner_dim, model.pos_embed_max_size, base)
        np.testing.assert_allclose(table, stored, atol=1e-6, rtol=0)
        assert np.abs(_swap_halves(table) - stored).max() > 0.1  # the check tells rows from columns


def test_save_then_load_round_trips_bitwise(loaded, tmp_path):
    bundle = loaded["sd35"]
    bundle.save(tmp_path / "transformer")
    assert sorted(p.name for p in (tmp_path / "transformer").iterdir()) == ["config.json", DIFFUSERS_FILE]
    ours = SafetensorsFile(tmp_path / "transformer" / DIFFUSERS_FILE)
    theirs = SafetensorsFile(FIXTURES / "sd35" / DIFFUSERS_FILE)
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    again = PretrainedSD3Transformer.load(tmp_path / "transformer")
    assert again.model == bundle.model
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), again.variables, bundle.variables))
    config = json.loads((tmp_path / "transformer" / "config.json").read_text())
    assert config["_class_name"] == "SD3Transformer2DModel" and config["dual_attention_layers"] == [0]
    with pytest.raises(FileExistsError, match="overwrite=True"):
        bundle.save(tmp_path / "transformer")


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_weights_load(loaded, tmp_path, dtype):
    """Released SD3 weights are float16 (the position table too); a bfloat16 save reads back as well."""
    bundle = loaded["sd3"]
    bundle.save(tmp_path / "half", dtype=dtype)
    half = SafetensorsFile(tmp_path / "half" / DIFFUSERS_FILE)
    assert {half[name].dtype for name in half} == {np.dtype(dtype)}
    again = PretrainedSD3Transformer.load(tmp_path / "half")
    expected = jax.tree.map(lambda a: np.asarray(a).astype(dtype).astype(np.float32), bundle.variables)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), again.variables, expected))


def test_sharded_weights_load_like_one_file(loaded, tmp_path):
    bundle, source = loaded["sd3"], SafetensorsFile(FIXTURES / "sd3" / DIFFUSERS_FILE)
    directory = tmp_path / "sharded"
    directory.mkdir()
    shutil.copyfile(FIXTURES / "sd3" / "config.json", directory / "config.json")
    names = sorted(source)
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[: len(names) // 2],
              "diffusion_pytorch_model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, held in shards.items():
        save_file({name: np.asarray(source[name]) for name in held}, directory / shard)
    weight_map = {name: shard for shard, held in shards.items() for name in held}
    (directory / DIFFUSERS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    sharded = PretrainedSD3Transformer.load(directory)
    flat, expected = (traverse_util.flatten_dict(b.variables["params"]) for b in (sharded, bundle))
    assert flat.keys() == expected.keys()
    assert all(np.array_equal(flat[key], expected[key]) for key in flat)


def random_variables(model, seed=0, scale=0.2):
    """Variables of the model's own structure drawn with NumPy (cheaper than compiling its init)."""
    from flax.core import meta

    abstract = meta.unbox(jax.eval_shape(model.init, jax.random.key(0), *example_inputs(model)))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda leaf: jnp.asarray(scale * rng.standard_normal(leaf.shape), leaf.dtype), abstract)


def test_a_model_made_in_dew_saves_for_diffusers(loaded, tmp_path):
    model = loaded["sd35"].model
    bundle = PretrainedSD3Transformer.from_model(model, random_variables(model))
    bundle.save(tmp_path / "mine")
    again = PretrainedSD3Transformer.load(tmp_path / "mine")
    ref = reference("sd35")
    x, conditions = inputs(ref)
    np.testing.assert_array_equal(again(x, ref["timesteps"][0], conditions), bundle(x, ref["timesteps"][0], conditions))
    with pytest.raises(ValueError, match="missing params"):
        PretrainedSD3Transformer.from_model(model.clone(num_layers=4), bundle.variables).save(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("edit, error", [
    ({"_class_name": "UNet2DConditionModel"}, "not an SD3Transformer2DModel"),
    ({"qk_norm": "layer_norm"}, "qk_norm='layer_norm'"),
    ({"caption_projection_dim": 24}, "caption_projection_dim=24"),
    ({"pos_embed_max_size": None}, "pos_embed_max_size=None"),
    ({"skip_layers": [1]}, r"skip_layers=\[1\]"),
    ({"dual_attention_layers": [5]}, r"dual_attention_layers \[5\]"),
    ({"sample_size": 16}, "not the sin/cos table its config.json implies"),  # the stored table disagrees
    ({"num_layers": 2}, "unexpected tensors"),
])
def test_configs_dew_does_not_implement_are_refused(tmp_path, edit, error):
    directory = tmp_path / "transformer"
    shutil.copytree(FIXTURES / "sd35", directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=error):
        PretrainedSD3Transformer.load(directory)


def test_bad_input_is_refused_with_the_fix(loaded, tmp_path):
    bundle, ref = loaded["sd3"], reference("sd3")
    x, conditions = inputs(ref)
    t = ref["timesteps"][0]
    with pytest.raises(ValueError, match="needs condition 'pooled_projections'"):
        bundle(x, t, {"encoder_hidden_states": conditions["encoder_hidden_states"]})
    with pytest.raises(ValueError, match="not built for"):
        bundle(x, t, {**conditions, "guidance": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"'encoder_hidden_states' must be \[2, tokens, 32\]"):
        bundle(x, t, {**conditions, "encoder_hidden_states": jnp.zeros((2, 6, 16))})
    with pytest.raises(ValueError, match="in_channels=16"):
        bundle(x[..., :4], t, conditions)
    with pytest.raises(ValueError, match=r"timesteps must be \[2\]"):
        bundle(x, t[:1], conditions)
    with pytest.raises(ValueError, match="pos_embed_max_size=16 covers at most 16 x 16"):
        bundle(jnp.zeros((2, 34, 8, 16)), t, conditions)
    with pytest.raises(ValueError, match="not divisible by its patch size 2"):
        bundle(jnp.zeros((2, 9, 8, 16)), t, conditions)
    with pytest.raises(FileNotFoundError, match="transformer/ folder"):
        PretrainedSD3Transformer.load(tmp_path)
    with pytest.raises(ValueError, match=r"SD3Transformer.num_layers must be a positive integer; got 2.0"):
        bundle.model.clone(num_layers=2.0).check_settings()


@pytest.mark.reference
def test_diffusers_reads_what_dew_saves(loaded, tmp_path):
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    model = loaded["sd35"].model
    bundle = PretrainedSD3Transformer.from_model(model, random_variables(model, seed=3, scale=0.1))
    bundle.save(tmp_path / "transformer")
    theirs = diffusers.SD3Transformer2DModel.from_pretrained(tmp_path / "transformer").eval()
    ref = reference("sd35")
    x, conditions = inputs(ref, "wide_")
    for timesteps in ref["timesteps"]:
        with torch.no_grad():
            expected = theirs(
                hidden_states=torch.from_numpy(np.asarray(x).transpose(0, 3, 1, 2).copy()),
                encoder_hidden_states=torch.from_numpy(np.array(conditions["encoder_hidden_states"])),
                pooled_projections=torch.from_numpy(np.array(conditions["pooled_projections"])),
                timestep=torch.from_numpy(timesteps), return_dict=False,
            )[0].numpy().transpose(0, 2, 3, 1)
        got = np.asarray(bundle(x, timesteps, conditions))
        assert np.abs(expected).max() > 0.1  # the moved weights give a non-trivial output
        np.testing.assert_allclose(got, expected, atol=TOLERANCE, rtol=0)


@pytest.mark.reference
@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_structures_have_diffusers_tensor_names_and_shapes(name):
    """Full-size SD3 / SD3.5 structures, built without weights on torch's meta device."""
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    from dew.interop.sd3_transformer import POSITIONS, diffusers_config, diffusers_name
    from dew.interop.weight_map import _torch_shape, expected_params

    model = released_model(name)
    config = {key: value for key, value in diffusers_config(model).items() if not key.startswith("_")}
    with torch.device("meta"):
        theirs = diffusers.SD3Transformer2DModel(**config)
    shapes = {name: list(tensor.shape) for name, tensor in theirs.state_dict().items()}
    ours = {diffusers_name(path): _torch_shape(path, tuple(spec.shape))
            for path, spec in expected_params(model, *example_inputs(model)).items()}
    ours[POSITIONS] = [1, model.pos_embed_max_size ** 2, model.inner_dim]
    assert ours == shapes
