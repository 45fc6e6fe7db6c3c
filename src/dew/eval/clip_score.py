"""CLIPScore (Hessel et al. 2021): how well generated images match their prompts, by a CLIP model.

For each image and its prompt, ``100 * max(cos(image features, text features), 0)`` with the
features CLIP's projected embeddings; the pass's score is the mean over every pair. That is the
definition torchmetrics documents; its code clamps the mean instead of each pair, which differs
only when some pair's cosine is negative (never for a trained CLIP on real prompts, often for a
tiny random one).

Images come in Dew's range ([-1, 1] floats, or uint8) and go through CLIP's preprocessing in JAX
(`clip_pixels`): the shorter side resized to the tower's size (bicubic, antialiased), the centre
cropped square, CLIP's mean and std. This is transformers' CLIPImageProcessor on float images
(its torchvision backend); its PIL backend rounds to whole levels and clamps, a few hundredths
apart.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.interop.clip import PretrainedCLIP
from dew.pixels import to_unit_range

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's per-channel pixel mean and std
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def clip_pixels(images: Any, size: int, *, mean: Sequence[float] = CLIP_MEAN,
                std: Sequence[float] = CLIP_STD) -> jax.Array:
    """Images [B, H, W, 3] (uint8, or float in [-1, 1]) -> CLIP pixels [B, size, size, 3].

    The shorter side becomes ``size`` and the longer ``int(size * long / short)`` (bicubic with
    antialiasing, no clamping), then the centre ``size`` x ``size`` is cut (offsets rounded as
    torchvision rounds them) and normalized with ``mean`` and ``std``.
    """
    images = jnp.asarray(images)
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"clip_pixels takes RGB images [B, H, W, 3]; got shape {tuple(images.shape)}")
    x = (to_unit_range(images).astype(jnp.float32) + 1.0) / 2.0
    batch, height, width, _ = x.shape
    longer = int(size * max(height, width) / min(height, width))
    resized = (size, longer) if height <= width else (longer, size)
    x = jax.image.resize(x, (batch, *resized, 3), "cubic", antialias=True)
    top, left = (int(round((side - size) / 2.0)) for side in resized)
    x = x[:, top:top + size, left:left + size]
    return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


def clip_scores(image_features: Any, text_features: Any) -> np.ndarray:
    """Per pair, ``100 * max(cos, 0)`` between rows of image and text features [B, D]."""
    image = np.asarray(image_features, np.float64)
    text = np.asarray(text_features, np.float64)
    if image.shape != text.shape or image.ndim != 2:
        raise ValueError(f"clip_scores pairs features [B, D] row by row; got {image.shape} and {text.shape}")
    cosines = np.sum(image * text, axis=-1) / (np.linalg.norm(image, axis=-1) * np.linalg.norm(text, axis=-1))
    return 100.0 * np.maximum(cosines, 0.0)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _image_features(model: Any, size: int, mean: tuple, std: tuple, variables: Any, images: jax.Array) -> jax.Array:
    return model.apply(variables, clip_pixels(images, size, mean=mean, std=std)).projected


def _caption_decoder(captions: Any) -> Callable[[np.ndarray], str]:
    """A function from one row of token ids to its text, from a TextCondition, a CaptionTokens or a tokenizer."""
    tokenizer = getattr(captions, "tokens", captions)  # a TextCondition holds its CaptionTokens
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a CaptionTokens holds its tokenizer
    if not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(
            f"CLIPScore.captions turns the batch's caption ids back into text: pass the TextCondition "
            f"(or its tokenizer) the ids were made with; got {type(captions).__name__}"
        )
    if "skip_special_tokens" in inspect.signature(tokenizer.decode).parameters:
        return lambda row: tokenizer.decode(row, skip_special_tokens=True)
    return tokenizer.decode  # a tokenizer with no special tokens to skip


@dataclasses.dataclass(frozen=True, eq=False)
class CLIPScore:
    """The mean CLIPScore of a pass (see the module doc), or of one call on images and prompts.

    ``clip`` is a `PretrainedCLIP` or a transformers CLIPModel directory. As a metric it reads
    images from the evaluate outputs' ``key`` and prompts from ``caption_key``: strings, or token
    ids decoded with ``captions`` (the `TextCondition` they were tokenized with), so a text-to-image
    run scores its samples against its validation captions. Pairs accumulate over the whole pass.
    """

    clip: Any
    key: str = "samples"
    caption_key: str = "caption"
    captions: Any = None
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD
    name: str = "clip_score"

    def __post_init__(self):
        clip = self.clip
        if isinstance(clip, (str, os.PathLike)):
            clip = PretrainedCLIP.load(clip)
            object.__setattr__(self, "clip", clip)
        if not isinstance(clip, PretrainedCLIP):
            raise TypeError(f"CLIPScore.clip must be a PretrainedCLIP or a CLIPModel directory; got {type(clip).__name__}")
        if clip.text is None or clip.vision.projection_dim is None or not clip.text.model.projection_dim:
            raise ValueError(
                "CLIPScore compares projected image and text embeddings, so it needs a full CLIPModel (both "
                "towers and both projections); this directory lacks the text tower or a projection"
            )
        if clip.text.tokens is None:
            raise ValueError("CLIPScore needs the CLIP model's tokenizer.json beside its weights to read prompts")
        object.__setattr__(self, "mean", tuple(float(value) for value in self.mean))
        object.__setattr__(self, "std", tuple(float(value) for value in self.std))

    def image_features(self, images: Any) -> np.ndarray:
        """Images [B, H, W, 3] -> CLIP's projected image embeddings [B, projection_dim]."""
        vision = self.clip.vision
        return np.asarray(_image_features(vision, vision.image_size, self.mean, self.std,
                                          self.clip.vision_variables, jnp.asarray(images)))

    def text_features(self, prompts: Sequence[str]) -> np.ndarray:
        """Prompts -> CLIP's projected text embeddings [B, projection_dim]."""
        return np.asarray(self.clip.text(list(prompts)).projected)

    def scores(self, images: Any, prompts: Sequence[str]) -> np.ndarray:
        """One score per (image, prompt) pair, ``100 * max(cos, 0)``."""
        prompts = [str(prompt) for prompt in prompts]
        if len(prompts) != len(images):
            raise ValueError(f"CLIPScore pairs each image with one prompt; got {len(images)} images and {len(prompts)} prompts")
        return clip_scores(self.image_features(images), self.text_features(prompts))

    def __call__(self, images: Any, prompts: Sequence[str]) -> float:
        """The mean score of these pairs, outside any validation pass."""
        return float(np.mean(self.scores(images, prompts)))

    # --- the Metric protocol ------------------------------------------------------------------------

    def empty(self):
        return 0.0, 0

    def _prompts(self, outputs: Mapping[str, np.ndarray]) -> list[str]:
        if self.caption_key not in outputs:
            raise KeyError(
                f"CLIPScore reads prompts from {self.caption_key!r} in the evaluate() outputs, which hold "
                f"{sorted(k for k in outputs if not k.startswith('_'))}; a text-conditioned diffusion run "
                "returns its caption ids there when it draws samples (evaluation_steps=)"
            )
        column = np.asarray(outputs[self.caption_key])
        if column.dtype.kind in "OUS":
            return [str(text) for text in column]
        if self.captions is None:
            raise ValueError(
                f"{self.caption_key!r} holds token ids; pass CLIPScore(captions=) the TextCondition they were "
                "tokenized with so they can be read back as text"
            )
        decode = _caption_decoder(self.captions)
        return [decode(row) for row in column]

    def update(self, accumulator, outputs):
        total, scored = accumulator
        if self.key not in outputs:
            raise KeyError(
                f"CLIPScore reads images from {self.key!r} in the evaluate() outputs, which hold "
                f"{sorted(k for k in outputs if not k.startswith('_'))}; set key= or draw samples in evaluate()"
            )
        values = self.scores(np.asarray(outputs[self.key]), self._prompts(outputs))
        return total + float(np.sum(values)), scored + values.size

    def result(self, accumulator):
        total, scored = accumulator
        return {self.name: total / scored if scored else float("nan")}
