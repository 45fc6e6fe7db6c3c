"""AutoencoderKL: the VAE of Stable Diffusion, SDXL, SD3 and Flux (Rombach et al. 2022, section 3).

    encoder: conv_in (3x3, block_out_channels[0])
             for each level l: layers_per_block x ResnetBlock(block_out_channels[l]),
                               then a stride-2 3x3 conv (padded only right and bottom) but at the last
             mid: ResnetBlock, single-head self-attention, ResnetBlock
             GroupNorm -> SiLU -> conv_out (3x3, 2 * latent_channels: mean and log-variance)
             quant_conv (1x1) when use_quant_conv
    decoder: post_quant_conv (1x1) when use_post_quant_conv, conv_in (3x3, block_out_channels[-1])
             mid as above
             for each level, widest first: (layers_per_block + 1) x ResnetBlock,
                               then nearest 2x upsampling + 3x3 conv but at the last
             GroupNorm -> SiLU -> conv_out (3x3, out_channels)

A ResnetBlock is GroupNorm -> SiLU -> conv -> GroupNorm -> SiLU -> conv, added to the input (through
a 1x1 ``conv_shortcut`` when the width changes). Every GroupNorm has eps 1e-6.

The encoder's output is a diagonal Gaussian posterior over latents, log-variance clamped to
[-30, 20]. `encode` returns ``(z - shift_factor) * scaling_factor`` with z the posterior mean
(``key=None``) or a draw from it, so the latents a diffusion model sees have about unit variance;
`decode` undoes that before decoding. Parameter names follow diffusers' (``down_blocks_0/resnets_1/
conv1``), so `dew.interop.autoencoders` maps checkpoints by renaming alone.

A model bound to its weights (``model.bind(variables)``) is an `Autoencoder` in the sense of
`dew.objectives.diffusion`: it has `encode`, `decode` and `latent_shape`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn.embeddings import dense
from dew.nn.norms import GroupNorm

NORM_EPS = 1e-6
LOGVAR_RANGE = (-30.0, 20.0)


CONV_INIT = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")  # PyTorch's default


class PointwiseConv(nn.Module):
    """A 1x1 conv with nn.Conv's parameters (``kernel [1, 1, in, features]``, ``bias``), run as one
    matrix product over the pixels: XLA:CPU's convolution of 4 x 256 x 256 x 128 -> 64 took 125
    against 28 ms as a product (docs/scaling.md)."""

    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    kernel_init: Any = nn.with_logical_partitioning(CONV_INIT, (None, None, None, "embed"))

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", self.kernel_init, (1, 1, x.shape[-1], self.features), self.param_dtype)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                          (self.features,), self.param_dtype)
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
        return jnp.einsum("...c,co->...o", x, kernel[0, 0]) + bias


def conv(features: int, name: str, *, kernel: int = 3, stride: int = 1, padding: Any = None,
         dtype: Any, param_dtype: Any) -> nn.Module:
    """A conv with a logically named kernel [k, k, in, out]; 'same' padding unless given (a 1x1 conv
    with neither stride nor padding is a `PointwiseConv`)."""
    if kernel == 1 and stride == 1 and padding is None:
        return PointwiseConv(features, dtype=dtype, param_dtype=param_dtype, name=name)
    if padding is None:
        padding = ((kernel // 2, kernel // 2),) * 2
    return nn.Conv(
        features, kernel_size=(kernel, kernel), strides=(stride, stride), padding=padding,
        dtype=dtype, param_dtype=param_dtype,
        kernel_init=nn.with_logical_partitioning(CONV_INIT, (None, None, None, "embed")),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
        name=name,
    )


def _phase_taps(kernel: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """A 3x3 kernel's three taps along `axis` folded into the two each output phase reads.

    After nearest 2x upsampling, output row 2i reads input rows i-1, i, i (taps 0, 1, 2) and row
    2i+1 reads rows i, i, i+1: phase 0 is taps (0, 1+2) over rows (i-1, i), phase 1 taps (0+1, 2)
    over rows (i, i+1)."""
    tap = [jnp.take(kernel, i, axis=axis) for i in range(3)]
    return jnp.stack([tap[0], tap[1] + tap[2]], axis), jnp.stack([tap[0] + tap[1], tap[2]], axis)


class UpsampleConv(nn.Module):
    """Nearest 2x upsampling, then a 3x3 'same' conv (the up blocks of UNets and VAE decoders).

    The parameters are those of `conv` (``kernel [3, 3, in, features]``, ``bias``), but the conv runs
    at the input's resolution: each of the four output phases (row and column parity) is a 2x2 conv
    of the input with the taps that land on the same input pixel summed, and the phases are
    interleaved. That is 4 instead of 9 products per output pixel and no upsampled copy of the input:
    an SD VAE decoder's 128-channel upsampling of 4 x 128 x 128 took 179 against 317 ms on a 2-core
    CPU (docs/scaling.md). ``size`` other than twice the input (a UNet's odd skip) upsamples to it
    and convolves there, as PyTorch's nearest resize does.
    """

    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, size: tuple[int, int] | None = None) -> jax.Array:
        batch, height, width, channels = x.shape
        kernel = self.param("kernel", nn.with_logical_partitioning(CONV_INIT, (None, None, None, "embed")),
                            (3, 3, channels, self.features), self.param_dtype)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                          (self.features,), self.param_dtype)
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
        numbers = ("NHWC", "HWIO", "NHWC")
        if size is not None and tuple(size) != (2 * height, 2 * width):
            rows = (jnp.arange(size[0]) * height) // size[0]
            cols = (jnp.arange(size[1]) * width) // size[1]
            x = jnp.take(jnp.take(x, rows, axis=1), cols, axis=2)
            return jax.lax.conv_general_dilated(x, kernel, (1, 1), ((1, 1), (1, 1)), dimension_numbers=numbers) + bias
        pads = ((1, 0), (0, 1))  # phase 0 reads rows (i-1, i), phase 1 rows (i, i+1)
        rows = []
        for row_phase, row_taps in enumerate(_phase_taps(kernel, 0)):
            phases = [
                jax.lax.conv_general_dilated(x, taps, (1, 1), (pads[row_phase], pads[col_phase]),
                                             dimension_numbers=numbers)
                for col_phase, taps in enumerate(_phase_taps(row_taps, 1))
            ]  # [B, H, W, features] each; stacked, column 2j + phase
            rows.append(jnp.stack(phases, axis=3).reshape(batch, height, 2 * width, self.features))
        return jnp.stack(rows, axis=2).reshape(batch, 2 * height, 2 * width, self.features) + bias


class ResnetBlock(nn.Module):
    """GroupNorm -> SiLU -> conv1 -> GroupNorm -> SiLU -> conv2, plus the (projected) input."""

    features: int
    num_groups: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h = nn.silu(GroupNorm(self.num_groups, NORM_EPS, name="norm1", **kw)(x))
        h = conv(self.features, "conv1", **kw)(h)
        h = nn.silu(GroupNorm(self.num_groups, NORM_EPS, name="norm2", **kw)(h))
        h = conv(self.features, "conv2", **kw)(h)
        if x.shape[-1] != self.features:
            x = conv(self.features, "conv_shortcut", kernel=1, **kw)(x)
        return x + h


class SpatialAttention(nn.Module):
    """GroupNorm, then one attention head over the H*W positions (head width = channels), added back."""

    num_groups: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        batch, height, width, channels = x.shape
        h = GroupNorm(self.num_groups, NORM_EPS, name="group_norm", **kw)(x).reshape(batch, height * width, channels)
        q = dense(channels, ("embed", "heads"), "to_q", **kw)(h)
        k = dense(channels, ("embed", "heads"), "to_k", **kw)(h)
        v = dense(channels, ("embed", "heads"), "to_v", **kw)(h)
        scores = jnp.einsum("bqc,bkc->bqk", q, k).astype(jnp.float32) / math.sqrt(channels)
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # softmax in float32, as diffusers
        h = dense(channels, ("heads", "embed"), "to_out", **kw)(jnp.einsum("bqk,bkc->bqc", weights, v))
        return x + h.reshape(x.shape)


class MidBlock(nn.Module):
    """ResnetBlock, self-attention (unless ``attention`` is False), ResnetBlock, at constant width."""

    num_groups: int
    attention: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(num_groups=self.num_groups, dtype=self.dtype, param_dtype=self.param_dtype)
        x = ResnetBlock(x.shape[-1], name="resnets_0", **kw)(x)
        if self.attention:
            x = SpatialAttention(name="attention", **kw)(x)
        return ResnetBlock(x.shape[-1], name="resnets_1", **kw)(x)


class Encoder(nn.Module):
    """Images [B, H, W, C] -> [B, H / 2^(levels-1), W / 2^(levels-1), 2 * latent_channels]."""

    block_out_channels: Sequence[int]
    layers_per_block: int
    latent_channels: int
    num_groups: int
    mid_attention: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h = conv(self.block_out_channels[0], "conv_in", **kw)(x)
        last = len(self.block_out_channels) - 1
        for level, features in enumerate(self.block_out_channels):
            for i in range(self.layers_per_block):
                h = ResnetBlock(features, self.num_groups, name=f"down_blocks_{level}/resnets_{i}", **kw)(h)
            if level != last:
                # diffusers' Downsample2D(padding=0): pad one row and column at the far ends, stride 2
                h = conv(features, f"down_blocks_{level}/downsample", stride=2,
                         padding=((0, 1), (0, 1)), **kw)(h)
        h = MidBlock(self.num_groups, self.mid_attention, name="mid_block", **kw)(h)
        h = nn.silu(GroupNorm(self.num_groups, NORM_EPS, name="conv_norm_out", **kw)(h))
        return conv(2 * self.latent_channels, "conv_out", **kw)(h)


class Decoder(nn.Module):
    """Latents [B, h, w, latent_channels] -> images [B, h * 2^(levels-1), w * 2^(levels-1), out_channels]."""

    block_out_channels: Sequence[int]
    layers_per_block: int
    out_channels: int
    num_groups: int
    mid_attention: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        widths = list(reversed(self.block_out_channels))
        h = conv(widths[0], "conv_in", **kw)(z)
        h = MidBlock(self.num_groups, self.mid_attention, name="mid_block", **kw)(h)
        last = len(widths) - 1
        for level, features in enumerate(widths):
            for i in range(self.layers_per_block + 1):
                h = ResnetBlock(features, self.num_groups, name=f"up_blocks_{level}/resnets_{i}", **kw)(h)
            if level != last:
                h = UpsampleConv(features, name=f"up_blocks_{level}/upsample", **kw)(h)
        h = nn.silu(GroupNorm(self.num_groups, NORM_EPS, name="conv_norm_out", **kw)(h))
        return conv(self.out_channels, "conv_out", **kw)(h)


class AutoencoderKL(nn.Module):
    """The KL-regularized autoencoder of latent diffusion, with diffusers' configuration names.

    Defaults are SD 1.x/2.x's VAE (4 latent channels, scaling_factor 0.18215); SDXL's differs only
    in scaling_factor 0.13025, SD3's and Flux's have 16 latent channels, no quant convs and a
    shift_factor. ``init`` runs `__call__` on images [B, H, W, in_channels]; H and W must be
    multiples of 2^(len(block_out_channels) - 1), every width a multiple of norm_num_groups.
    """

    in_channels: int = 3
    out_channels: int = 3
    block_out_channels: Sequence[int] = (128, 256, 512, 512)
    layers_per_block: int = 2
    latent_channels: int = 4
    norm_num_groups: int = 32
    scaling_factor: float = 0.18215
    shift_factor: float = 0.0
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        for features in self.block_out_channels:
            if features % self.norm_num_groups:
                raise ValueError(
                    f"AutoencoderKL: width {features} in block_out_channels={tuple(self.block_out_channels)} "
                    f"is not a multiple of norm_num_groups={self.norm_num_groups}; GroupNorm splits "
                    "every width into that many groups"
                )
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        shared = dict(block_out_channels=tuple(self.block_out_channels), layers_per_block=self.layers_per_block,
                      num_groups=self.norm_num_groups, mid_attention=self.mid_block_add_attention, **kw)
        self.encoder = Encoder(latent_channels=self.latent_channels, **shared)
        self.decoder = Decoder(out_channels=self.out_channels, **shared)
        if self.use_quant_conv:
            self.quant_conv = conv(2 * self.latent_channels, "quant_conv", kernel=1, **kw)
        if self.use_post_quant_conv:
            self.post_quant_conv = conv(self.latent_channels, "post_quant_conv", kernel=1, **kw)

    @property
    def downsampling(self) -> int:
        """How many pixels of each side one latent covers: 2 per level but the last."""
        return 2 ** (len(self.block_out_channels) - 1)

    def latent_shape(self, sample_shape: Sequence[int]) -> tuple[int, ...]:
        """The latent shape of one image of shape (H, W, C), checked against the model."""
        if len(sample_shape) != 3 or sample_shape[-1] != self.in_channels:
            raise ValueError(
                f"AutoencoderKL encodes images (height, width, {self.in_channels}); got sample shape "
                f"{tuple(sample_shape)}"
            )
        height, width, _ = sample_shape
        if height % self.downsampling or width % self.downsampling:
            raise ValueError(
                f"AutoencoderKL: image sides must be multiples of {self.downsampling} (2 per level "
                f"of block_out_channels={tuple(self.block_out_channels)} but the last); got "
                f"{height}x{width}. Resize or crop the images."
            )
        return (height // self.downsampling, width // self.downsampling, self.latent_channels)

    def posterior(self, images: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Images in [-1, 1], [B, H, W, in_channels] -> the posterior's (mean, logvar), unscaled."""
        self.latent_shape(images.shape[1:])
        moments = self.encoder(images.astype(self.dtype))
        if self.use_quant_conv:
            moments = self.quant_conv(moments)
        mean, logvar = jnp.split(moments.astype(jnp.float32), 2, axis=-1)
        return mean, jnp.clip(logvar, *LOGVAR_RANGE)

    def encode(self, images: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """Scaled latents of images in [-1, 1]: the posterior mean, or a draw from it with ``key``."""
        mean, logvar = self.posterior(images)
        z = mean if key is None else mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, mean.shape)
        return (z - self.shift_factor) * self.scaling_factor

    def decode(self, latents: jax.Array) -> jax.Array:
        """Scaled latents [B, h, w, latent_channels] -> images (about [-1, 1], not clipped)."""
        if latents.ndim != 4 or latents.shape[-1] != self.latent_channels:
            raise ValueError(
                f"AutoencoderKL decodes latents [batch, height, width, {self.latent_channels}]; got "
                f"shape {tuple(latents.shape)}"
            )
        z = (latents.astype(jnp.float32) / self.scaling_factor + self.shift_factor).astype(self.dtype)
        if self.use_post_quant_conv:
            z = self.post_quant_conv(z)
        return self.decoder(z).astype(jnp.float32)

    def __call__(self, images: jax.Array, key: jax.Array | None = None):
        """Reconstruct images: (reconstruction, mean, logvar), decoding a posterior draw with ``key``."""
        mean, logvar = self.posterior(images)
        z = mean if key is None else mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, mean.shape)
        if self.use_post_quant_conv:
            z = self.post_quant_conv(z.astype(self.dtype))
        return self.decoder(z.astype(self.dtype)).astype(jnp.float32), mean, logvar
