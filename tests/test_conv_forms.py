"""The convs Dew computes in another form than nn.Conv, with nn.Conv's parameters: UpsampleConv
(nearest 2x upsampling + 3x3 conv as four phase convs at the input's size) and PointwiseConv (a 1x1
conv as a matrix product)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.vae import CONV_INIT, PointwiseConv, UpsampleConv, conv

NUMBERS = ("NHWC", "HWIO", "NHWC")


class Plain(nn.Module):
    """The reference: PyTorch's nearest resize to `size`, then `conv` (a 3x3 'same' nn.Conv)."""

    features: int

    @nn.compact
    def __call__(self, x, size=None):
        batch, height, width, channels = x.shape
        size = (2 * height, 2 * width) if size is None else size
        rows = (jnp.arange(size[0]) * height) // size[0]
        cols = (jnp.arange(size[1]) * width) // size[1]
        x = jnp.take(jnp.take(x, rows, axis=1), cols, axis=2)
        return conv(self.features, "up", dtype=jnp.float32, param_dtype=jnp.float32)(x)


def build(features):
    """UpsampleConv and the reference, each holding its conv as a child named "up"."""

    class Ours(nn.Module):
        @nn.compact
        def __call__(self, x, size=None):
            return UpsampleConv(features, name="up")(x, size)

    return Ours(), Plain(features)


@pytest.mark.parametrize("shape", [(2, 5, 7, 6), (1, 8, 8, 16)])
def test_values_and_gradients_match_upsampling_then_conv(shape):
    x = jax.random.normal(jax.random.key(0), shape)
    ours, plain = build(9)
    variables = plain.init(jax.random.key(1), x)
    assert jax.tree.map(jnp.shape, ours.init(jax.random.key(1), x)) == jax.tree.map(jnp.shape, variables)
    # the same key gives the same weights: UpsampleConv's parameters are nn.Conv's, name for name
    jax.tree.map(np.testing.assert_array_equal, ours.init(jax.random.key(1), x), variables)
    variables = jax.tree.map(lambda v: v + 0.1, variables)  # a nonzero bias too
    np.testing.assert_allclose(ours.apply(variables, x), plain.apply(variables, x), atol=1e-5, rtol=1e-5)

    cotangent = jax.random.normal(jax.random.key(2), (shape[0], 2 * shape[1], 2 * shape[2], 9))
    loss = lambda module: lambda v, x: jnp.sum(module.apply(v, x) * cotangent)  # noqa: E731
    ours_grads = jax.grad(loss(ours), argnums=(0, 1))(variables, x)
    plain_grads = jax.grad(loss(plain), argnums=(0, 1))(variables, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5), ours_grads, plain_grads)


def test_an_odd_target_size_upsamples_as_pytorch_does():
    x = jax.random.normal(jax.random.key(0), (1, 3, 4, 5))
    ours, plain = build(4)
    variables = plain.init(jax.random.key(1), x)
    for size in [(5, 7), (6, 8)]:
        np.testing.assert_allclose(ours.apply(variables, x, size), plain.apply(variables, x, size), atol=1e-5)


def test_a_wrong_phase_would_be_caught():
    """Negative control: swapping the two phases' taps (reading rows i, i+1 for even rows) moves the
    output by far more than the tolerance above."""
    x = jax.random.normal(jax.random.key(0), (1, 6, 6, 4))
    kernel = jax.random.normal(jax.random.key(1), (3, 3, 4, 3))
    upsampled = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
    expected = jax.lax.conv_general_dilated(upsampled, kernel, (1, 1), ((1, 1), (1, 1)), dimension_numbers=NUMBERS)
    variables = {"params": {"kernel": kernel, "bias": jnp.zeros(3)}}
    got = UpsampleConv(3).apply(variables, x)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    flipped = UpsampleConv(3).apply({"params": {"kernel": kernel[::-1], "bias": jnp.zeros(3)}}, x)
    assert float(jnp.max(jnp.abs(flipped - expected))) > 0.1


def test_the_program_convolves_at_the_input_size():
    """No conv runs at the upsampled size, and no upsampled copy of the input is made: every
    convolution's output is the input's spatial size, with a 2x2 kernel."""
    x = jnp.zeros((2, 16, 16, 8))
    module = UpsampleConv(8)
    variables = module.init(jax.random.key(0), x)
    text = jax.jit(module.apply).lower(variables, x).as_text()
    convs = [line for line in text.splitlines() if "stablehlo.convolution" in line]
    assert len(convs) == 4, convs
    assert all("tensor<2x16x16x8xf32>" in line and "tensor<2x2x8x8xf32>" in line for line in convs), convs


def test_a_pointwise_conv_is_nn_conv_with_a_product():
    x = jax.random.normal(jax.random.key(0), (2, 5, 6, 7))
    reference = nn.Conv(  # what `conv(4, name, kernel=1)` built before PointwiseConv
        4, (1, 1), kernel_init=nn.with_logical_partitioning(CONV_INIT, (None, None, None, "embed")),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))
    ours = PointwiseConv(4)
    variables = reference.init(jax.random.key(1), x)
    jax.tree.map(np.testing.assert_array_equal, ours.init(jax.random.key(1), x), variables)  # same init
    variables = jax.tree.map(lambda v: v + 0.1, variables)
    np.testing.assert_allclose(ours.apply(variables, x), reference.apply(variables, x), atol=1e-5, rtol=1e-5)
    loss = lambda module: lambda v, x: jnp.sum(jnp.sin(module.apply(v, x)))  # noqa: E731
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5),
                 jax.grad(loss(ours), argnums=(0, 1))(variables, x), jax.grad(loss(reference), argnums=(0, 1))(variables, x))
    text = jax.jit(ours.apply).lower(variables, x).as_text()
    assert "stablehlo.convolution" not in text and "stablehlo.dot_general" in text


def test_conv_gives_the_pointwise_form_only_for_a_plain_1x1():
    kw = dict(dtype=jnp.float32, param_dtype=jnp.float32)
    assert isinstance(conv(4, "a", kernel=1, **kw), PointwiseConv)
    assert isinstance(conv(4, "b", kernel=1, stride=2, **kw), nn.Conv)
    assert isinstance(conv(4, "c", kernel=1, padding=((0, 1), (0, 1)), **kw), nn.Conv)
    assert isinstance(conv(4, "d", **kw), nn.Conv)
