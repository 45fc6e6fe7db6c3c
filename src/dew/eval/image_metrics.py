"""Image metrics: PSNR, SSIM and FID over a validation pass, the feature networks FID reads, and
image grids for previews.

Metrics read an objective's `evaluate` outputs (host NumPy arrays, one batch at a time). Images are
[B, H, W, C]: uint8 in 0..255, or float in Dew's [-1, 1] range (so PSNR and SSIM default to
`data_range=2.0`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dew.checks import count
from dew.files import write_atomic
from dew.pixels import png_bytes, to_uint8, to_unit_range

Features = Callable[[Any], Any]


# ----------------------------------------------------------------------------------------------
# PSNR and SSIM of image pairs


def _pair(a, b, what: str) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"{what} compares images of one shape; got {a.shape} and {b.shape}.")
    if a.ndim == 2:  # one grey image without a channel axis
        a, b = a[..., None], b[..., None]
    if a.ndim < 3:
        raise ValueError(f"{what} takes images [H, W, C] or [B, H, W, C]; got shape {a.shape}.")
    return a, b


def psnr(a, b, data_range: float) -> np.ndarray | float:
    """Peak signal-to-noise ratio in dB, 10 log10(range^2 / MSE), per image.

    Images are [H, W, C] (a float comes back) or [..., H, W, C] (one value per image); identical
    images give inf.
    """
    a, b = _pair(a, b, "psnr")
    mse = np.mean((a - b) ** 2, axis=(-3, -2, -1))
    with np.errstate(divide="ignore"):
        value = 10.0 * np.log10(float(data_range) ** 2 / mse)
    return float(value) if np.ndim(value) == 0 else value


def ssim(
    a, b, data_range: float, *, sigma: float = 1.5, k1: float = 0.01, k2: float = 0.03
) -> np.ndarray | float:
    """Structural similarity (Wang et al., 2004) with a Gaussian window, per image.

    Matches `skimage.metrics.structural_similarity(a, b, data_range=..., gaussian_weights=True,
    sigma=1.5, use_sample_covariance=False, channel_axis=-1)`: local statistics are Gaussian
    averages (reflected edges, truncated at 3.5 sigma), and the SSIM map is averaged over every
    channel after cutting the window's radius from each border.
    """
    from scipy.ndimage import gaussian_filter

    a, b = _pair(a, b, "ssim")
    radius = int(3.5 * sigma + 0.5)
    height, width = a.shape[-3:-1]
    if min(height, width) < 2 * radius + 1:
        raise ValueError(
            f"ssim's Gaussian window spans {2 * radius + 1} pixels, larger than the images "
            f"({height}x{width}); compare larger images or use a smaller sigma."
        )
    sigmas = [0.0] * (a.ndim - 3) + [sigma, sigma, 0.0]

    def blur(x):
        return gaussian_filter(x, sigma=sigmas, mode="reflect", truncate=3.5)

    ua, ub = blur(a), blur(b)
    va = blur(a * a) - ua * ua
    vb = blur(b * b) - ub * ub
    cov = blur(a * b) - ua * ub
    c1, c2 = (k1 * data_range) ** 2, (k2 * data_range) ** 2
    full = ((2 * ua * ub + c1) * (2 * cov + c2)) / ((ua**2 + ub**2 + c1) * (va + vb + c2))
    inner = full[..., radius : height - radius, radius : width - radius, :]
    value = inner.mean(axis=(-3, -2, -1))
    return float(value) if np.ndim(value) == 0 else value


def _images(outputs: Mapping[str, np.ndarray], key: str, metric: str) -> np.ndarray:
    if key not in outputs:
        raise KeyError(
            f"{metric} reads {key!r} from the objective's evaluate() outputs, which hold "
            f"{sorted(k for k in outputs if not k.startswith('_'))}; return it from evaluate() or "
            f"set the metric's key."
        )
    return np.asarray(outputs[key])


@dataclasses.dataclass(frozen=True)
class _MeanImageScore:
    """Mean per-image score over the pass, between outputs `key_a` and `key_b`."""

    key_a: str = "samples"
    key_b: str = "images"
    data_range: float = 2.0
    name: str = "score"

    def score(self, a: np.ndarray, b: np.ndarray):
        raise NotImplementedError

    def empty(self):
        return 0.0, 0

    def update(self, accumulator, outputs):
        total, scored = accumulator
        label = type(self).__name__
        a, b = _images(outputs, self.key_a, label), _images(outputs, self.key_b, label)
        values = np.atleast_1d(self.score(a, b))
        return total + float(np.sum(values)), scored + values.size

    def result(self, accumulator):
        total, scored = accumulator
        return {self.name: total / scored if scored else float("nan")}


@dataclasses.dataclass(frozen=True)
class PSNR(_MeanImageScore):
    """Mean per-image PSNR over the pass, between outputs `key_a` and `key_b`."""

    name: str = "psnr"

    def score(self, a, b):
        return psnr(a, b, self.data_range)


@dataclasses.dataclass(frozen=True)
class SSIM(_MeanImageScore):
    """Mean per-image SSIM over the pass, between outputs `key_a` and `key_b`."""

    name: str = "ssim"

    def score(self, a, b):
        return ssim(a, b, self.data_range)


# ----------------------------------------------------------------------------------------------
# FID


class FeatureMoments:
    """Running count, sum and sum of outer products of feature vectors (float64), for the mean and
    covariance of a whole pass without keeping the features."""

    def __init__(self):
        self.count = 0
        self.total: np.ndarray | None = None
        self.outer: np.ndarray | None = None

    def add(self, features) -> FeatureMoments:
        features = np.asarray(features, dtype=np.float64)
        if features.ndim != 2:
            raise ValueError(f"Features must be [B, D]; the feature network gave shape {features.shape}.")
        if self.total is None:
            dim = features.shape[1]
            self.total, self.outer = np.zeros(dim), np.zeros((dim, dim))
        elif features.shape[1] != self.total.shape[0]:
            raise ValueError(
                f"Features changed width from {self.total.shape[0]} to {features.shape[1]} mid-pass."
            )
        self.count += features.shape[0]
        self.total += features.sum(axis=0)
        self.outer += features.T @ features
        return self

    @property
    def mean(self) -> np.ndarray:
        return self.total / self.count

    @property
    def cov(self) -> np.ndarray:
        """The unbiased covariance (divides by count - 1, as numpy.cov does)."""
        if self.count < 2:
            raise ValueError(f"A covariance needs at least 2 feature vectors; the pass gave {self.count}.")
        mean = self.mean
        return (self.outer - self.count * np.outer(mean, mean)) / (self.count - 1)


def frechet_distance(mu1, sigma1, mu2, sigma2, eps: float = 1e-6) -> float:
    """The Fréchet distance between Gaussians N(mu1, sigma1) and N(mu2, sigma2) (Heusel et al., 2017):
    |mu1 - mu2|^2 + Tr(sigma1 + sigma2 - 2 (sigma1 sigma2)^(1/2)).

    As in pytorch-fid, a product whose square root is not finite (near-singular covariances, fewer
    samples than dimensions) is retried with `eps` added to both diagonals; the square root's
    imaginary part (numerical noise) is dropped.
    """
    from scipy import linalg

    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    sigma1 = np.atleast_2d(np.asarray(sigma1, np.float64))
    sigma2 = np.atleast_2d(np.asarray(sigma2, np.float64))
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape or sigma1.shape != mu1.shape * 2:
        raise ValueError(
            f"frechet_distance needs means of one width and matching covariances; got means "
            f"{mu1.shape}, {mu2.shape} and covariances {sigma1.shape}, {sigma2.shape}."
        )
    diff = mu1 - mu2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", linalg.LinAlgWarning)
        covmean = linalg.sqrtm(sigma1 @ sigma2)
        if not np.isfinite(covmean).all():
            offset = np.eye(len(mu1)) * eps
            covmean = linalg.sqrtm((sigma1 + offset) @ (sigma2 + offset))
    covmean = np.real(covmean)
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * np.trace(covmean))


@dataclasses.dataclass(frozen=True)
class FID:
    """Fréchet distance between features of generated (`key`) and real (`reference_key`) images.

    The mean and covariance of each set accumulate over the whole validation pass (float64 sums on
    the host), so the score is that of the pass, not an average over batches. `features` is any
    callable from images [B, H, W, C] to [B, D] (`InceptionFeatures` for standard FID).
    `reference` replaces the real images with precomputed statistics: a (mean, covariance) pair or
    a .npz file holding "mu" and "sigma" (pytorch-fid's format).
    """

    features: Features
    key: str = "samples"
    reference_key: str = "images"
    reference: Any = None
    name: str = "fid"

    def __post_init__(self):
        if not callable(self.features):
            raise TypeError(
                f"FID.features must be a callable from images [B, H, W, C] to features [B, D]; "
                f"got {type(self.features).__name__}."
            )

    def empty(self):
        return FeatureMoments(), FeatureMoments()

    def update(self, accumulator, outputs):
        generated, real = accumulator
        generated.add(self.features(_images(outputs, self.key, "FID")))
        if self.reference is None:
            real.add(self.features(_images(outputs, self.reference_key, "FID")))
        return generated, real

    def result(self, accumulator):
        generated, real = accumulator
        if self.reference is None:
            mu, sigma = real.mean, real.cov
        else:
            mu, sigma = _reference_statistics(self.reference)
        return {self.name: frechet_distance(generated.mean, generated.cov, mu, sigma)}


def _reference_statistics(reference) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(reference, (str, os.PathLike)):
        path = Path(reference)
        if not path.is_file():
            raise FileNotFoundError(f"FID reference statistics file {str(path)!r} does not exist.")
        with np.load(path) as archive:
            if "mu" not in archive or "sigma" not in archive:
                raise ValueError(f"{path} must hold arrays 'mu' and 'sigma'; it holds {archive.files}.")
            return archive["mu"], archive["sigma"]
    mu, sigma = reference
    return np.asarray(mu), np.asarray(sigma)


# ----------------------------------------------------------------------------------------------
# Feature networks


class InceptionFeatures:
    """The 2048 pool3 features of the FID Inception-v3, from a weights file on disk.

    `weights_path` is a .npz or .safetensors of pytorch-fid's state dict (see `dew.eval.inception`);
    nothing is downloaded. Images are resized (bilinear, no antialiasing, as pytorch-fid does) to
    `size` x `size`; grey images are repeated to three channels.
    """

    def __init__(self, weights_path: str | os.PathLike, *, size: int = 299):
        import jax

        from dew.eval.inception import FIDInception, read_tensors, variables_from_torch

        self.weights_path = str(weights_path)
        self.size = size
        self.variables = jax.tree.map(
            jax.numpy.asarray, variables_from_torch(read_tensors(weights_path), self.weights_path)
        )
        model = FIDInception()

        def apply(variables, images):
            x = to_unit_range(images)
            if x.shape[-1] == 1:
                x = jax.numpy.repeat(x, 3, axis=-1)
            x = jax.image.resize(x, (x.shape[0], size, size, 3), "bilinear", antialias=False)
            return model.apply(variables, x)

        self._apply = jax.jit(apply)

    def __call__(self, images) -> np.ndarray:
        images = np.asarray(images)
        if images.ndim != 4 or images.shape[-1] not in (1, 3):
            raise ValueError(
                f"InceptionFeatures takes images [B, H, W, 1 or 3]; got shape {images.shape}."
            )
        return np.asarray(self._apply(self.variables, images))


class RandomConvFeatures:
    """A small fixed random conv net (two strided 3x3 ReLU convolutions, mean pooling, a random
    projection to `dim`): a cheap stand-in for Inception in tests and smoke runs. Its weights are a
    function of `seed` and the channel count only."""

    def __init__(self, seed: int = 0, dim: int = 64):
        import jax

        self.seed, self.dim = seed, dim
        self._weights: dict[int, tuple] = {}

        def apply(weights, images):
            w1, w2, projection = weights
            x = to_unit_range(images)
            dims = ("NHWC", "HWIO", "NHWC")
            x = jax.nn.relu(jax.lax.conv_general_dilated(x, w1, (2, 2), "SAME", dimension_numbers=dims))
            x = jax.nn.relu(jax.lax.conv_general_dilated(x, w2, (2, 2), "SAME", dimension_numbers=dims))
            return x.mean(axis=(1, 2)) @ projection

        self._apply = jax.jit(apply)

    def _for_channels(self, channels: int) -> tuple:
        if channels not in self._weights:
            rng = np.random.default_rng([self.seed, channels])
            w1 = rng.standard_normal((3, 3, channels, 32)) / math.sqrt(9 * channels)
            w2 = rng.standard_normal((3, 3, 32, 64)) / math.sqrt(9 * 32)
            projection = rng.standard_normal((64, self.dim)) / 8.0
            self._weights[channels] = tuple(np.asarray(w, np.float32) for w in (w1, w2, projection))
        return self._weights[channels]

    def __call__(self, images) -> np.ndarray:
        images = np.asarray(images)
        if images.ndim != 4:
            raise ValueError(f"RandomConvFeatures takes images [B, H, W, C]; got shape {images.shape}.")
        return np.asarray(self._apply(self._for_channels(images.shape[-1]), images))


# ----------------------------------------------------------------------------------------------
# Image grids


def image_grid(images, rows: int | None = None, *, padding: int = 0) -> np.ndarray:
    """Tile images [N, H, W, C] (uint8, or float in [-1, 1]) into one uint8 [H', W', C] grid.

    `rows` defaults to a near-square layout; empty cells (and `padding` pixels between cells) are black.
    """
    rows = count(rows, "image_grid rows", optional=True)
    padding = count(padding, "image_grid padding", minimum=0)
    images = to_uint8(images)
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or len(images) == 0:
        raise ValueError(f"image_grid takes a non-empty batch [N, H, W, C]; got shape {images.shape}.")
    n_images, height, width, channels = images.shape
    if rows is None:
        columns = math.ceil(math.sqrt(n_images))
        rows = math.ceil(n_images / columns)
    else:
        columns = math.ceil(n_images / rows)
    step_h, step_w = height + padding, width + padding
    grid = np.zeros((rows * step_h - padding, columns * step_w - padding, channels), np.uint8)
    for index, image in enumerate(images[: rows * columns]):
        row, column = divmod(index, columns)
        grid[row * step_h : row * step_h + height, column * step_w : column * step_w + width] = image
    return grid


def save_image_grid(images, path: str | os.PathLike, rows: int | None = None, *, padding: int = 0) -> Path:
    """Write `image_grid(images, rows)` as a PNG at `path`, atomically (a temporary file renamed)."""
    return write_atomic(path, png_bytes(image_grid(images, rows, padding=padding)))
