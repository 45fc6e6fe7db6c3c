"""SimpleDiT and UNet conditioned on captions: cross-attention to the text tokens and the pooled text."""

from __future__ import annotations

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.diffusion.presets import Flow
from dew.interop.text_encoders import PretrainedTextEncoder
from dew.nn.backbones.dit import SimpleDiT
from dew.nn.backbones.unet import UNet
from dew.objectives.base import Field, InputSpec, Step
from dew.objectives.diffusion import DiffusionObjective
from dew.objectives.text_condition import TextCondition

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "text_encoders"
TEXT = 32  # the fixture CLIP's hidden size
CAPTIONS = ["a red square", "a blue square", "a green square", "a dark square"]


def dit(text_features=TEXT):
    return SimpleDiT(patch_size=2, emb_features=32, num_layers=1, num_heads=2, text_features=text_features)


def unet(text_features=TEXT):
    # one level with no attention of its own: the middle block's self- and cross-attention
    return UNet(channels=8, channel_mults=(1,), num_res_blocks=1, attention_resolutions=(), num_heads=2,
                text_features=text_features)


BACKBONES = {"dit": dit, "unet": unet}


@pytest.fixture(scope="module")
def clip():
    return PretrainedTextEncoder.load(FIXTURES / "clip")


def randomized(variables, seed=0, scale=0.2):
    """Every weight redrawn at random, so the zero-initialized branches (gates, outputs) take part."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda leaf: jnp.asarray(scale * rng.standard_normal(leaf.shape), leaf.dtype),
                        nn.unbox(variables))


def images_of(count):
    colors = np.array([[220, 30, 30], [30, 30, 220], [30, 220, 30], [20, 20, 20]], np.uint8)
    return np.broadcast_to(colors[np.arange(count) % 4][:, None, None, :], (count, 8, 8, 3)).copy()


def objective(model, condition, prob=0.1):
    inputs = InputSpec(Field("image", (8, 8, 3)), conditions={"caption": condition})
    return DiffusionObjective(model, Flow(), inputs, unconditional_prob=prob)


def apply(model, variables, text, mask=None):
    x = jax.random.normal(jax.random.key(5), (text.shape[0], 8, 8, 3))
    conditions = {"text": text} if mask is None else {"text": text, "text_mask": mask}
    return np.asarray(jax.jit(model.apply)(variables, x, jnp.full((text.shape[0],), 0.4), conditions))


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_a_captioned_set_trains_through_the_diffusion_objective(name, clip):
    diffusion = objective(BACKBONES[name](), TextCondition(clip, mask=True))
    variables = jax.jit(diffusion.init)(jax.random.key(0))
    batch = {"image": jnp.asarray(images_of(8)), "caption": jnp.asarray(diffusion.inputs.conditions["caption"].tokenize(CAPTIONS * 2))}
    diffusion.check(batch)
    step = Step(jnp.int32(0), jax.random.key(1))  # one fixed draw of noise and dropped rows: a loss that can only move by training

    def loss(params, frozen):
        return diffusion.loss({**frozen, "params": params}, batch, step)[0]

    optimizer = optax.adam(3e-3)
    params = variables["params"]
    frozen = {key: value for key, value in variables.items() if key != "params"}

    @jax.jit
    def train(params):
        """The losses of 20 Adam steps, and the loss after them (one compilation)."""
        def one(carry, _):
            params, opt_state = carry
            value, grads = jax.value_and_grad(loss)(params, frozen)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), value
        (params, _), losses = jax.lax.scan(one, (params, optimizer.init(params)), None, length=20)
        return losses, loss(params, frozen)

    losses, after = train(params)
    before = float(losses[0])
    assert np.isfinite(float(after)) and float(after) < 0.8 * before
    assert set(variables["params"]) >= {"pooled_text_embed"}  # the text reached the backbone's parameters


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_the_output_reads_the_caption_and_not_the_masked_padding(name, clip):
    model = BACKBONES[name]()
    condition = TextCondition(clip, mask=True)
    encode = jax.jit(condition.encode)
    a = encode(condition.tokenize(["a red square", "a red square"]))
    b = encode(condition.tokenize(["a blue square", "a blue square"]))
    variables = randomized(jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((2, 8, 8, 3)), jnp.zeros((2,)), a))
    out_a = apply(model, variables, a["text"], a["text_mask"])
    assert np.abs(out_a - apply(model, variables, b["text"], b["text_mask"])).max() > 1e-3  # another caption, another output

    mask = np.asarray(a["text_mask"])
    padding = ~mask[..., None]
    noise = np.asarray(jax.random.normal(jax.random.key(9), a["text"].shape))
    scrambled = jnp.where(padding, noise, a["text"])  # only the tokens past end-of-text change
    np.testing.assert_allclose(apply(model, variables, scrambled, a["text_mask"]), out_a, atol=1e-5, rtol=0)
    # negative control: the same scrambling without the mask reaches the output
    assert np.abs(apply(model, variables, scrambled) - apply(model, variables, a["text"])).max() > 1e-3


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_a_fresh_text_branch_leaves_the_unconditioned_model_as_it_was(name):
    """Same parameter layout for an unconditioned model; the cross-attention and the pooled text start at
    zero, so weights of the unconditioned model inside a text model give its output for any text."""
    plain, texted = BACKBONES[name](None), BACKBONES[name]()
    x, t = jnp.zeros((2, 8, 8, 3)), jnp.zeros((2,))
    text = jax.random.normal(jax.random.key(3), (2, 5, TEXT))
    plain_variables = randomized(jax.eval_shape(plain.init, jax.random.key(0), x, t))
    text_variables = nn.unbox(jax.jit(texted.init)(jax.random.key(0), x, t, {"text": text}))
    assert not any("cross" in "/".join(map(str, path)) or "pooled_text" in "/".join(map(str, path))
                   for path, _ in jax.tree_util.tree_leaves_with_path(plain_variables))

    def overlay(fresh, trained):
        if isinstance(fresh, dict):
            return {key: overlay(value, trained[key]) if key in trained else value for key, value in fresh.items()}
        return trained

    merged = overlay(text_variables, plain_variables)
    want = np.asarray(jax.jit(plain.apply)(plain_variables, jax.random.normal(jax.random.key(5), x.shape), jnp.full((2,), 0.4)))
    np.testing.assert_allclose(apply(texted, merged, text), want, atol=1e-6, rtol=0)
    # negative control: once the text branch has weights, the same text changes the output
    assert np.abs(apply(texted, randomized(text_variables, seed=1), text) - want).max() > 1e-3


@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_guidance_draws_through_the_task(name, clip):
    diffusion = objective(BACKBONES[name](), TextCondition(clip))
    variables = jax.eval_shape(diffusion.init, jax.random.key(0))
    task = diffusion.task({"params": randomized(variables["params"])})
    prompts = ["a red square", "a blue square"]
    guided = task(prompts, steps=2, guidance=3.0, key=jax.random.key(3)).host().images
    plain = task(prompts, steps=2, guidance=None, key=jax.random.key(3)).host().images
    assert guided.shape == (2, 8, 8, 3) and np.isfinite(guided).all()
    assert np.abs(guided - plain).max() > 1e-3  # the guidance reached the draw


def test_text_of_the_wrong_width_is_refused():
    model = dit()
    with pytest.raises(ValueError, match=r"'text' must be \[2, tokens, 32\]"):
        model.init(jax.random.key(0), jnp.zeros((2, 8, 8, 3)), jnp.zeros((2,)), {"text": jnp.ones((2, 5, 8))})
    with pytest.raises(ValueError, match="not built for"):
        dit(None).init(jax.random.key(0), jnp.zeros((2, 8, 8, 3)), jnp.zeros((2,)), {"text": jnp.ones((2, 5, 32))})
    with pytest.raises(ValueError, match="text_features must be a positive integer"):
        unet(0).init(jax.random.key(0), jnp.zeros((2, 8, 8, 3)), jnp.zeros((2,)))
