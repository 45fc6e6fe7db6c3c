"""GroupNorm (dew.nn.norms) against torch's definition, and Flax's parameter layout."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.norms import GroupNorm


def reference(x, groups, eps, scale, bias):
    """torch.nn.functional.group_norm in float64: per example and group, two-pass variance."""
    x = np.asarray(x, np.float64)
    shape = x.shape
    grouped = x.reshape(shape[0], -1, groups, shape[-1] // groups)
    mean = grouped.mean(axis=(1, 3), keepdims=True)
    var = ((grouped - mean) ** 2).mean(axis=(1, 3), keepdims=True)
    return ((grouped - mean) / np.sqrt(var + eps)).reshape(shape) * scale + bias


@pytest.mark.parametrize("shape,groups", [((2, 6, 5, 32), 8), ((3, 2, 4, 4, 12), 3), ((2, 7, 64), 32)])
def test_group_norm_computes_torchs_group_norm(shape, groups):
    rng = np.random.default_rng(0)
    # an offset well away from zero: E[x^2] - E[x]^2 must still hold at float32
    x = (rng.standard_normal(shape) * 2.0 + 3.0).astype(np.float32)
    module = GroupNorm(groups, epsilon=1e-6)
    scale = rng.standard_normal(shape[-1]).astype(np.float32)
    bias = rng.standard_normal(shape[-1]).astype(np.float32)
    variables = {"params": {"scale": jnp.asarray(scale), "bias": jnp.asarray(bias)}}
    out = np.asarray(jax.jit(module.apply)(variables, x))
    expected = reference(x, groups, 1e-6, scale, bias)
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=1e-5)
    # negative control: statistics over all channels at once (one group) differ visibly
    assert np.abs(reference(x, 1, 1e-6, scale, bias) - expected).max() > 1e-2
    # per-channel statistics (as many groups as channels) differ too
    assert np.abs(reference(x, shape[-1], 1e-6, scale, bias) - expected).max() > 1e-2


def test_group_norm_keeps_flaxs_parameters_and_output():
    x = jax.random.normal(jax.random.key(1), (2, 8, 8, 64)) * 0.5 + 0.25
    ours, flax_norm = GroupNorm(32, epsilon=1e-5), nn.GroupNorm(num_groups=32, epsilon=1e-5)
    variables = nn.unbox(ours.init(jax.random.key(0), x))
    flax_variables = flax_norm.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, flax_variables)
    variables = {"params": {"scale": jnp.linspace(0.5, 2.0, 64), "bias": jnp.linspace(-1.0, 1.0, 64)}}
    np.testing.assert_allclose(ours.apply(variables, x), flax_norm.apply(variables, x), atol=1e-5)
    # the logical axis names sharding reads
    boxed = ours.init(jax.random.key(0), x)["params"]
    assert boxed["scale"].names == ("norm",) and boxed["bias"].names == ("norm",)


def test_group_norm_gradients_match_flaxs():
    x = jax.random.normal(jax.random.key(2), (2, 4, 4, 16))
    ours, flax_norm = GroupNorm(4), nn.GroupNorm(num_groups=4)
    variables = {"params": {"scale": jnp.linspace(0.5, 2.0, 16), "bias": jnp.zeros(16)}}
    weights = jax.random.normal(jax.random.key(3), x.shape)

    def loss(module):
        return lambda v, x: jnp.sum(module.apply(v, x) * weights)

    ours_grads = jax.grad(loss(ours), argnums=(0, 1))(variables, x)
    flax_grads = jax.grad(loss(flax_norm), argnums=(0, 1))(variables, x)
    for a, b in zip(jax.tree.leaves(ours_grads), jax.tree.leaves(flax_grads)):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_group_norm_computes_in_float32_and_returns_its_dtype():
    x = (jax.random.normal(jax.random.key(4), (2, 4, 4, 8)) * 3 + 1).astype(jnp.bfloat16)
    module = GroupNorm(2, dtype=jnp.bfloat16)
    variables = module.init(jax.random.key(0), x)
    out = module.apply(variables, x)
    assert out.dtype == jnp.bfloat16
    expected = reference(np.asarray(x, np.float32), 2, 1e-5, 1.0, 0.0)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=3e-2)


def test_group_norm_refuses_groups_that_do_not_divide_the_channels():
    with pytest.raises(ValueError, match="12 channels do not split into 5 groups"):
        GroupNorm(5, name="norm1").init(jax.random.key(0), jnp.zeros((1, 2, 2, 12)))
