"""UNet2DCondition against diffusers' UNet2DConditionModel: fixtures written by
tools/unet_condition_fixtures.py (tiny SD 1.5-, SD 2.1- and SDXL-structured UNets)."""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from dew.interop.unet_condition import CLASS_NAME, PretrainedUNet
from dew.nn.backbones.unet_condition import UNet2DCondition, timestep_features

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "unet_condition"
NAMES = ("sd15", "sd21", "sdxl")
TOLERANCE = 1e-4  # float32 outputs against diffusers'


def reference(name):
    return np.load(FIXTURES / name / "reference.npz")


def conditions(ref):
    return {key: ref[key] for key in ("encoder_hidden_states", "text_embeds", "time_ids") if key in ref}


@pytest.fixture(scope="module")
def loaded():
    return {name: PretrainedUNet.load(FIXTURES / name) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_outputs_match_diffusers(loaded, name):
    ref = reference(name)
    out = loaded[name](ref["sample"], ref["timesteps"], conditions(ref))
    assert ref["timesteps"][1] % 1 != 0  # one of the two timesteps is fractional
    np.testing.assert_allclose(out, ref["output"], atol=TOLERANCE, rtol=0)


def test_odd_latent_sides_upsample_to_the_skips_size(loaded):
    """7x9 latents: the stride-2 convs round up, and each upsampler matches its skip, as in diffusers."""
    ref = reference("sd15")
    out = loaded["sd15"](ref["odd_sample"], ref["timesteps"], conditions(ref))
    assert out.shape == (2, 7, 9, 4)
    np.testing.assert_allclose(out, ref["odd_output"], atol=TOLERANCE, rtol=0)


def test_bfloat16_compute_stays_near_the_float32_reference():
    """dtype=bfloat16 computes in bf16 (SD 2.1's upcast attention in float32) from float32 weights."""
    ref = reference("sd21")
    unet = PretrainedUNet.load(FIXTURES / "sd21", dtype=jnp.bfloat16)
    out = unet(ref["sample"].astype(jnp.bfloat16), ref["timesteps"], conditions(ref))
    assert out.dtype == jnp.bfloat16 and unet.variables["params"]["conv_in"]["kernel"].dtype == jnp.float32
    error = np.abs(np.asarray(out, np.float32) - ref["output"]).max()
    assert 100 * TOLERANCE < error < 0.05  # bf16 rounding, not a float32 computation, and not a wrong one


def test_config_settings_are_read(loaded):
    sd15, sd21, sdxl = (loaded[name].model for name in NAMES)
    assert (sd15.num_attention_heads, sd15.use_linear_projection, sd15.upcast_attention) == (2, False, False)
    assert (sd21.num_attention_heads, sd21.use_linear_projection, sd21.upcast_attention) == ((2, 4), True, True)
    assert sdxl.transformer_layers_per_block == (1, 1, 2) and sdxl.addition_embed_type == "text_time"
    assert sdxl.down_block_types == ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D")
    assert loaded["sdxl"].config["sample_size"] == 8
    params = traverse_util.flatten_dict(loaded["sdxl"].variables["params"], sep="/")
    # the mid block's transformer has transformer_layers_per_block[-1] = 2 blocks; level 1 has 1
    assert "mid_block/attentions_0/transformer_blocks_1/attn2/to_k/kernel" in params
    assert "down_blocks_1/attentions_0/transformer_blocks_1/attn2/to_k/kernel" not in params


def test_timestep_features_follow_diffusers_order_and_shift():
    t = jnp.array([3.0])
    flipped = timestep_features(t, 6, flip_sin_to_cos=True, freq_shift=0)
    freqs = np.exp(-np.log(10000.0) * np.arange(3) / 3)
    np.testing.assert_allclose(flipped[0], np.concatenate([np.cos(3 * freqs), np.sin(3 * freqs)]), rtol=1e-6)
    shifted = timestep_features(t, 7, flip_sin_to_cos=False, freq_shift=1)
    freqs = np.exp(-np.log(10000.0) * np.arange(3) / 2)
    np.testing.assert_allclose(shifted[0], np.concatenate([np.sin(3 * freqs), np.cos(3 * freqs), [0.0]]),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mistake", [
    "sin_cos_order", pytest.param("head_split", marks=pytest.mark.slow), "time_ids_order"])
def test_a_realistic_mistake_breaks_parity(loaded, mistake):
    """Negative control: each mistake moves the outputs far beyond the tolerance the parity test uses."""
    name = {"sin_cos_order": "sd15", "head_split": "sd21", "time_ids_order": "sdxl"}[mistake]
    bundle, ref = loaded[name], reference(name)
    given = conditions(ref)
    if mistake == "sin_cos_order":
        bundle = PretrainedUNet(bundle.model.clone(flip_sin_to_cos=False), bundle.variables)
    elif mistake == "head_split":
        # reading attention_head_dim as the head width: 8 / 2 and 16 / 4 channels -> 4 heads each
        bundle = PretrainedUNet(bundle.model.clone(num_attention_heads=(4, 4)), bundle.variables)
    else:
        given = {**given, "time_ids": given["time_ids"][:, [1, 0, 3, 2, 5, 4]]}  # (width, height) for (height, width)
    out = bundle(ref["sample"], ref["timesteps"], given)
    assert np.abs(np.asarray(out) - ref["output"]).max() > 100 * TOLERANCE


def test_save_then_load_round_trips_bitwise(loaded, tmp_path):
    bundle, ref = loaded["sdxl"], reference("sdxl")
    bundle.save(tmp_path / "unet")
    written = sorted(p.name for p in (tmp_path / "unet").iterdir())
    assert written == ["config.json", "diffusion_pytorch_model.safetensors"]
    again = PretrainedUNet.load(tmp_path / "unet")
    assert again.model == bundle.model and again.config["sample_size"] == 8
    mine, theirs = (traverse_util.flatten_dict(b.variables["params"]) for b in (bundle, again))
    assert mine.keys() == theirs.keys()
    for path in mine:
        np.testing.assert_array_equal(theirs[path], mine[path], err_msg="/".join(path))
    np.testing.assert_array_equal(again(ref["sample"], ref["timesteps"], conditions(ref)),
                                  bundle(ref["sample"], ref["timesteps"], conditions(ref)))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        bundle.save(tmp_path / "unet")


def test_sharded_weights_load_as_one_file_does(loaded, tmp_path):
    from dew.interop.safetensors_io import SafetensorsFile, save_file

    whole = SafetensorsFile(FIXTURES / "sd15" / "diffusion_pytorch_model.safetensors")
    names = sorted(whole)
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[::2],
              "diffusion_pytorch_model-00002-of-00002.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(FIXTURES / "sd15" / "config.json", sharded)
    for shard, members in shards.items():
        save_file({name: whole[name] for name in members}, sharded / shard)
    index = {"weight_map": {name: shard for shard, members in shards.items() for name in members}}
    (sharded / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    again = PretrainedUNet.load(sharded)
    jax.tree.map(np.testing.assert_array_equal, again.variables["params"], loaded["sd15"].variables["params"])


def test_a_model_made_in_dew_saves_for_diffusers(tmp_path):
    from flax.core import meta

    model = UNet2DCondition(block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=1,
                            num_attention_heads=2, cross_attention_dim=8, norm_num_groups=4)
    x, t, given = jnp.zeros((1, 4, 4, 4)), jnp.zeros((1,)), {"encoder_hidden_states": jnp.zeros((1, 3, 8))}
    abstract = meta.unbox(jax.eval_shape(model.init, jax.random.key(0), x, t, given))
    rng = np.random.default_rng(0)
    variables = jax.tree.map(lambda leaf: jnp.asarray(rng.standard_normal(leaf.shape), leaf.dtype), abstract)
    PretrainedUNet.from_model(model, variables).save(tmp_path / "mine")
    config = json.loads((tmp_path / "mine" / "config.json").read_text())
    assert config["_class_name"] == CLASS_NAME and config["attention_head_dim"] == 2
    assert config["num_attention_heads"] is None  # diffusers reads the head count from attention_head_dim
    again = PretrainedUNet.load(tmp_path / "mine")
    assert again.model == model
    jax.tree.map(np.testing.assert_array_equal, again.variables["params"], variables["params"])
    with pytest.raises(ValueError, match="missing params"):
        PretrainedUNet.from_model(model.clone(layers_per_block=2), variables).save(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def _with_config(tmp_path, name, **changes):
    other = tmp_path / f"{name}-changed"
    shutil.copytree(FIXTURES / name, other, dirs_exist_ok=True)
    config = json.loads((FIXTURES / name / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, **changes}))
    return other


@pytest.mark.parametrize("key, value", [
    ("class_embed_type", "projection"), ("resnet_time_scale_shift", "scale_shift"), ("attention_type", "gated"),
    ("mid_block_type", "UNetMidBlock2D"), ("encoder_hid_dim_type", "text_proj"), ("dual_cross_attention", True),
    ("num_attention_heads", 4), ("time_cond_proj_dim", 256), ("some_future_setting", 3),
])
def test_settings_dew_does_not_build_are_refused_by_name(tmp_path, key, value):
    with pytest.raises(ValueError, match=f"{key}={value!r}"):
        PretrainedUNet.load(_with_config(tmp_path, "sd15", **{key: value}))


def test_bad_directories_and_inputs_are_refused_with_the_fix(loaded, tmp_path):
    with pytest.raises(ValueError, match="not a UNet2DConditionModel"):
        PretrainedUNet.load(_with_config(tmp_path, "sd15", _class_name="AutoencoderKL"))
    with pytest.raises(ValueError, match="unexpected tensors"):
        PretrainedUNet.load(_with_config(tmp_path, "sd21", layers_per_block=0))
    with pytest.raises(ValueError, match="must mirror down_block_types"):
        PretrainedUNet.load(_with_config(tmp_path, "sd15", up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"]))
    with pytest.raises(FileNotFoundError, match="unet/ folder"):
        PretrainedUNet.load(tmp_path)

    ref = reference("sdxl")
    sdxl = loaded["sdxl"]
    with pytest.raises(ValueError, match=r"'text_embeds' \[batch, pooled\].*'time_ids'"):
        sdxl(ref["sample"], ref["timesteps"], {"encoder_hidden_states": ref["encoder_hidden_states"]})
    with pytest.raises(ValueError, match=r"encoder_hidden_states'\] must be \[2, tokens, 16\]"):
        sdxl(ref["sample"], ref["timesteps"], {**conditions(ref), "encoder_hidden_states": np.zeros((2, 5, 8))})
    with pytest.raises(ValueError, match="pooled \\+ n \\* 4"):
        sdxl(ref["sample"], ref["timesteps"], {**conditions(ref), "time_ids": np.zeros((2, 5))})
    with pytest.raises(ValueError, match="got condition 'text_embeds'"):
        loaded["sd15"](ref["sample"], ref["timesteps"], conditions(ref))


@pytest.mark.reference
@pytest.mark.parametrize("name", ["sd21", "sdxl"])
def test_diffusers_reads_what_dew_saves(loaded, tmp_path, name):
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    ref = reference(name)
    loaded[name].save(tmp_path / "unet")
    theirs = diffusers.UNet2DConditionModel.from_pretrained(tmp_path / "unet").eval()
    added = None
    if "time_ids" in ref:
        added = {key: torch.from_numpy(ref[key]) for key in ("text_embeds", "time_ids")}
    with torch.no_grad():
        out = theirs(torch.from_numpy(ref["sample"].transpose(0, 3, 1, 2).copy()), torch.from_numpy(ref["timesteps"]),
                     torch.from_numpy(ref["encoder_hidden_states"]), added_cond_kwargs=added).sample
    np.testing.assert_allclose(out.numpy().transpose(0, 2, 3, 1), ref["output"], atol=TOLERANCE, rtol=0)
