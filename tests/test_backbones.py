"""Diffusion backbones: shapes, zero start, conditioning conventions, factorized attention, errors."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Aux, Dataset, Field, InputSpec, Objective, Trainer
from dew.nn.backbones import MMDiT, SimpleDiT, UNet, VideoDiT
from dew.nn.embeddings import sincos_positions, unpatchify

B = 2
DIT = SimpleDiT(patch_size=2, emb_features=32, num_layers=1, num_heads=2, num_classes=10, condition_features=8)
UNET = UNet(channels=32, channel_mults=(1, 2), num_res_blocks=1, attention_resolutions=(4,), num_classes=10)
MMDIT = MMDiT(patch_size=2, emb_features=32, num_layers=2, num_heads=2, text_features=16)
VIDEO = VideoDiT(patch_size=2, tubelet_size=1, emb_features=32, num_layers=1, num_heads=2)

SHAPES = {"dit": (B, 8, 8, 3), "unet": (B, 8, 8, 1), "mmdit": (B, 8, 8, 3), "video": (B, 3, 4, 4, 2)}
MODELS = {"dit": DIT, "unet": UNET, "mmdit": MMDIT, "video": VIDEO}


def normal(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape)


@functools.cache
def apply_fn(name):
    return jax.jit(MODELS[name].apply)


def init_key():
    # the "rbg" generator compiles far faster than threefry on CPU; these tests only need some init
    return jax.random.key(0, impl="unsafe_rbg")


@functools.cache
def initial(name):
    """(output, variables) of the model's real initialization, without conditions, in one compile."""
    x = normal(2, SHAPES[name])
    init = jax.jit(MODELS[name].init_with_output)
    return init(init_key(), x, jnp.full((B,), 0.5), None)


@functools.cache
def abstract(name):
    """The model's variables as shapes (with their logical-axis boxes), traced without compiling."""
    return jax.eval_shape(MODELS[name].init, jax.random.key(0), jnp.zeros(SHAPES[name]), jnp.zeros(B), None)


@functools.cache
def trained(name, seed=1, scale=0.2):
    """Parameters as if trained: every leaf random (zero gates become active), drawn on the host."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda leaf: (scale * rng.standard_normal(leaf.shape)).astype(leaf.dtype), nn.unbox(abstract(name))
    )


def run(name, variables, x, t, conditions=None):
    return np.asarray(apply_fn(name)(variables, x, t, conditions))


# ---------------------------------------------------------------- shapes and the zero start


@pytest.mark.parametrize("name", sorted(MODELS))
def test_output_has_the_input_shape_and_is_exactly_zero_at_init(name):
    out, variables = initial(name)
    assert out.shape == SHAPES[name]
    assert np.all(np.asarray(out) == 0.0)
    assert jax.tree_util.tree_structure(nn.unbox(variables)) == jax.tree_util.tree_structure(trained(name))


def test_unet_works_at_32x32_with_attention_at_16():
    model = UNet(channels=32, channel_mults=(1, 2), num_res_blocks=1, attention_resolutions=(16,))
    x = jnp.zeros((B, 32, 32, 3))
    out, variables = jax.eval_shape(model.init_with_output, jax.random.key(0), x, jnp.zeros(B))
    assert out.shape == x.shape
    assert "down_1_attn_0" in variables["params"] and "down_0_attn_0" not in variables["params"]


def test_learn_sigma_doubles_the_output_channels():
    model = SimpleDiT(patch_size=2, emb_features=32, num_layers=1, num_heads=2, learn_sigma=True)
    out = jax.eval_shape(lambda x: model.init_with_output(jax.random.key(0), x, jnp.zeros(B))[0],
                         jnp.zeros((B, 8, 8, 3)))
    assert out.shape == (B, 8, 8, 6)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_noise_input_changes_the_output_once_trained(name):
    x = normal(2, SHAPES[name])
    low = run(name, trained(name), x, jnp.full((B,), 0.1))
    high = run(name, trained(name), x, jnp.full((B,), 0.9))
    negative = run(name, trained(name), x, jnp.full((B,), -1.2))  # EDM's c_noise can be negative
    assert np.all(np.isfinite(low)) and np.abs(low - high).max() > 1e-3
    assert np.abs(negative - low).max() > 1e-3


def test_patchify_round_trips_and_positions_are_distinct():
    x = normal(4, (B, 4, 6, 3))
    tokens = x.reshape(B, 2, 2, 3, 2, 3).transpose(0, 1, 3, 2, 4, 5).reshape(B, 6, 12)
    np.testing.assert_array_equal(unpatchify(tokens, (2, 3), (2, 2), 3), x)
    for grid in [(4, 4), (2, 3, 3)]:
        table = sincos_positions(32, grid)
        assert table.shape == (int(np.prod(grid)), 32)
        assert len({row.tobytes() for row in table}) == len(table)


# ---------------------------------------------------------------- the condition convention


def test_null_label_equals_a_missing_label_and_classes_differ():
    x, t = normal(5, SHAPES["dit"]), jnp.full((B,), 0.3)
    params = trained("dit")
    missing = run("dit", params, x, t, {})
    np.testing.assert_allclose(run("dit", params, x, t, None), missing, atol=1e-6)
    np.testing.assert_allclose(run("dit", params, x, t, {"label": jnp.array([-1, 10])}), missing, atol=1e-6)
    one = run("dit", params, x, t, {"label": jnp.array([1, 1])})
    two = run("dit", params, x, t, {"label": jnp.array([2, 2])})
    assert np.abs(one - two).max() > 1e-3 and np.abs(one - missing).max() > 1e-3
    # dropping the label of row 1 only: row 1 is the unconditional output, row 0 stays conditional
    mixed = run("dit", params, x, t, {"label": jnp.array([1, -1])})
    np.testing.assert_allclose(mixed[0], one[0], atol=1e-6)
    np.testing.assert_allclose(mixed[1], missing[1], atol=1e-6)


def test_zero_embedding_rows_equal_a_missing_embedding():
    x, t = normal(6, SHAPES["dit"]), jnp.full((B,), 0.3)
    params = trained("dit")
    missing = run("dit", params, x, t, {})
    emb = normal(7, (B, 8)).at[1].set(0.0)
    out = run("dit", params, x, t, {"embedding": emb})
    np.testing.assert_allclose(out[1], missing[1], atol=1e-6)
    assert np.abs(out[0] - missing[0]).max() > 1e-3


def test_unet_labels_follow_the_same_convention():
    x, t = normal(8, SHAPES["unet"]), jnp.full((B,), 0.3)
    params = trained("unet")
    missing = run("unet", params, x, t, {})
    mixed = run("unet", params, x, t, {"label": jnp.array([4, -1])})
    np.testing.assert_allclose(mixed[1], missing[1], atol=1e-5)
    assert np.abs(mixed[0] - missing[0]).max() > 1e-3


def test_labels_above_the_null_id_are_clamped_to_null_under_jit():
    x, t = normal(9, SHAPES["dit"]), jnp.full((B,), 0.3)
    params = trained("dit")
    out = run("dit", params, x, t, {"label": jnp.array([99, 3])})  # traced: no eager check
    null = run("dit", params, x, t, {"label": jnp.array([-1, 3])})
    np.testing.assert_allclose(out, null, atol=1e-6)


def test_mmdit_text_changes_the_output_and_zeroed_rows_equal_missing_text():
    x, t = normal(10, SHAPES["mmdit"]), jnp.full((B,), 0.4)
    params = trained("mmdit")
    missing = run("mmdit", params, x, t, {})
    text_a, text_b = normal(11, (B, 5, 16)), normal(12, (B, 5, 16))
    a = run("mmdit", params, x, t, {"text": text_a})
    b = run("mmdit", params, x, t, {"text": text_b})
    assert np.abs(a - b).max() > 1e-3 and np.abs(a - missing).max() > 1e-3
    dropped = run("mmdit", params, x, t, {"text": text_a.at[1].set(0.0)})
    np.testing.assert_allclose(dropped[0], a[0], atol=1e-5)
    np.testing.assert_allclose(dropped[1], missing[1], atol=1e-5)
    # padding tokens, whether zero (tokens 5-7) or masked out (tokens 8-10), change nothing
    padded = jnp.concatenate([text_a, jnp.zeros((B, 3, 16)), text_b[:, :3]], axis=1)
    mask = jnp.arange(11)[None, :].repeat(B, 0) < 8
    np.testing.assert_allclose(run("mmdit", params, x, t, {"text": padded, "text_mask": mask}), a, atol=1e-5)


# ---------------------------------------------------------------- factorized attention


def test_video_dit_spatial_attention_mixes_patches_and_temporal_attention_mixes_frames():
    """Perturb one patch of frame 0 and see which (frame, patch) outputs move, with either
    attention switched off through its adaLN gate (chunks 2 and 5 of the block's modulation)."""
    x, t = normal(13, SHAPES["video"]), jnp.full((B,), 0.5)
    moved_x = x.at[:, 0, 0:2, 0:2].add(1.0)  # frame 0, the top-left 2x2 patch
    features = 32

    def without(params, chunk):
        params = jax.tree_util.tree_map(np.array, params)  # a copy
        proj = params["params"]["video_dit_block_0"]["modulation"]["proj"]
        span = slice(chunk * features, (chunk + 1) * features)
        proj["kernel"][:, span] = 0.0
        proj["bias"][span] = 0.0
        return params

    def moved(params):
        delta = np.abs(run("video", params, moved_x, t) - run("video", params, x, t))
        # [B, frames, 2, 2 patches] -> did anything in that (frame, patch) change?
        return delta.reshape(B, 3, 2, 2, 2, 2, 2).max(axis=(0, 3, 5, 6)) > 1e-5

    spatial_only = moved(without(trained("video"), 5))
    assert spatial_only[0].all() and not spatial_only[1:].any()
    temporal_only = moved(without(trained("video"), 2))
    assert temporal_only[:, 0, 0].all() and not temporal_only[:, 0, 1:].any() and not temporal_only[:, 1].any()
    assert moved(trained("video")).all()  # space then time: every token within one block


# ---------------------------------------------------------------- names, axes, training


def test_parameters_carry_block_names_and_logical_axes():
    params = abstract("dit")["params"]
    assert "dit_block_0" in params and "patch_embed" in params
    specs = nn.get_partition_spec(abstract("dit"))["params"]["dit_block_0"]
    assert tuple(specs["attn"]["qkv"]["proj"]["kernel"]) == ("embed", "heads")
    assert tuple(specs["attn"]["out"]["kernel"]) == ("heads", "embed")
    assert tuple(specs["mlp"]["fc1"]["kernel"]) == ("embed", "mlp")
    assert tuple(specs["mlp"]["fc2"]["kernel"]) == ("mlp", "embed")
    assert "mmdit_block_1" in abstract("mmdit")["params"]
    assert "video_dit_block_0" in abstract("video")["params"]


class Denoising(Objective):
    """Rectified-flow MSE on random images, with labels dropped on a random half of the rows."""

    inputs = InputSpec(Field("image", (8, 8, 3)), Field("label", ()))

    def __init__(self, model):
        self.model = model

    def init(self, key, variables=None):
        return self.model.init(key, jnp.zeros((1, 8, 8, 3)), jnp.zeros((1,)), None)

    def loss(self, variables, batch, step):
        x0 = batch["image"]
        time_key, noise_key, drop_key = jax.random.split(step.key, 3)
        t = jax.random.uniform(time_key, (x0.shape[0],))
        eps = jax.random.normal(noise_key, x0.shape)
        x_t = (1 - t)[:, None, None, None] * x0 + t[:, None, None, None] * eps
        labels = jnp.where(jax.random.bernoulli(drop_key, 0.5, t.shape), -1, batch["label"])
        out = self.model.apply(variables, x_t, t, {"label": labels})
        loss = jnp.mean((out - (eps - x0)) ** 2)
        return loss, Aux(metrics={"mse": loss})


def test_a_trainer_step_on_simple_dit_gives_a_finite_loss():
    rng = np.random.default_rng(0)
    data = Dataset.from_records(
        {"image": rng.uniform(-1, 1, (16, 8, 8, 3)).astype(np.float32),
         "label": rng.integers(0, 10, 16).astype(np.int32)},
        batch=8,
    )
    trainer = Trainer(Denoising(DIT), optax.adam(1e-3), key=init_key())
    state = trainer.fit(data, steps=2, log_every=1)
    assert int(state.step) == 2
    assert all(np.isfinite(row["loss"]) for row in trainer.history)


# ---------------------------------------------------------------- errors


def test_an_image_side_that_the_patch_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="width 9 is not divisible by its patch size 2"):
        DIT.apply(trained("dit"), jnp.zeros((B, 8, 9, 3)), jnp.zeros(B))
    with pytest.raises(ValueError, match="height 7 is not divisible"):
        MMDIT.apply(trained("mmdit"), jnp.zeros((B, 7, 8, 3)), jnp.zeros(B))
    with pytest.raises(ValueError, match="width 12 is not divisible by 8"):
        model = UNet(channels=32, channel_mults=(1, 1, 1, 1))
        model.init(jax.random.key(0), jnp.zeros((1, 16, 12, 1)), jnp.zeros(1))


def test_frames_that_the_tubelet_does_not_divide_are_refused():
    model = VideoDiT(patch_size=2, tubelet_size=2, emb_features=32, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match="frames 3 is not divisible by its patch size 2"):
        model.init(jax.random.key(0), jnp.zeros((1, 3, 4, 4, 2)), jnp.zeros(1))
    with pytest.raises(ValueError, match=r"expects input \[batch, frames, height, width, channels\]"):
        model.init(jax.random.key(0), jnp.zeros((1, 4, 4, 2)), jnp.zeros(1))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_inputs_with_other_channels_than_at_init_are_refused(name):
    shape = SHAPES[name][:-1] + (SHAPES[name][-1] + 1,)
    with pytest.raises(ValueError, match="channels, but the parameters were initialized for"):
        MODELS[name].apply(trained(name), jnp.zeros(shape), jnp.zeros(B))


def test_a_condition_the_model_was_not_built_for_is_refused():
    model = SimpleDiT(patch_size=2, emb_features=32, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match="got condition 'label'.*built unconditional"):
        model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)), jnp.zeros(1), {"label": jnp.zeros(1, jnp.int32)})
    with pytest.raises(ValueError, match="got condition 'text'.*accepts 'label'"):
        DIT.apply(trained("dit"), jnp.zeros(SHAPES["dit"]), jnp.zeros(B), {"text": jnp.zeros((B, 3, 8))})
    with pytest.raises(ValueError, match="got condition 'label'.*accepts 'text'"):
        MMDIT.apply(trained("mmdit"), jnp.zeros(SHAPES["mmdit"]), jnp.zeros(B), {"label": jnp.zeros(B, jnp.int32)})


def test_bad_condition_values_are_refused_eagerly():
    x, t = jnp.zeros(SHAPES["dit"]), jnp.zeros(B)
    with pytest.raises(ValueError, match="label 11 at row 1 is out of range for num_classes=10"):
        DIT.apply(trained("dit"), x, t, {"label": jnp.array([3, 11])})
    with pytest.raises(ValueError, match=r"'embedding' must be \[2, 8\]"):
        DIT.apply(trained("dit"), x, t, {"embedding": jnp.zeros((B, 5))})
    with pytest.raises(ValueError, match=r"'text' must be \[2, tokens, 16\]"):
        MMDIT.apply(trained("mmdit"), x, t, {"text": jnp.zeros((B, 4, 12))})


def test_over_tokens_is_a_broadcast_whose_gradient_is_a_product_with_ones():
    """adaLN's shifts, scales and gates: the values and gradients of a broadcast over the tokens,
    with the gradient's sum over the tokens compiled as a product (XLA:CPU runs the reduction over
    that middle axis at a sixth of the speed) instead of a reduce."""
    from dew.nn.vit import gated, modulate, over_tokens

    rng = np.random.default_rng(0)
    x, h = (jnp.asarray(rng.standard_normal((4, 6, 8)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)

    def dew(v, x, h):
        return jnp.sum(jnp.sin(gated(modulate(x, v, 2 * v), v, h)))

    def plain(v, x, h):
        return jnp.sum(jnp.sin((x * (1 + 2 * v[:, None]) + v[:, None]) + v[:, None] * h))

    np.testing.assert_array_equal(over_tokens(v, x.shape), jnp.broadcast_to(v[:, None], x.shape))
    assert float(dew(v, x, h)) == float(plain(v, x, h))
    for argnum in range(3):
        np.testing.assert_allclose(jax.grad(dew, argnum)(v, x, h), jax.grad(plain, argnum)(v, x, h), atol=1e-5)
    tangent = jax.jvp(lambda v: modulate(x, v, v), (v,), (v,))[1]  # forward mode too
    np.testing.assert_allclose(tangent, jax.jvp(lambda v: x * (1 + v[:, None]) + v[:, None], (v,), (v,))[1], atol=1e-6)
    one = v[:1]  # one conditioning row for every example, as before
    np.testing.assert_allclose(jax.grad(lambda u: jnp.sum(jnp.sin(modulate(x, u, u))))(one),
                               jax.grad(lambda u: jnp.sum(jnp.sin(x * (1 + u[:, None]) + u[:, None])))(one), atol=1e-5)
    # the gradient with respect to v: a dot_general over the tokens, where the plain broadcast reduces
    ours = jax.jit(jax.grad(dew)).lower(v, x, h).as_text()
    theirs = jax.jit(jax.grad(plain)).lower(v, x, h).as_text()
    assert ours.count("stablehlo.dot_general") == 3 and theirs.count("stablehlo.dot_general") == 0
    assert "stablehlo.reduce" in theirs
