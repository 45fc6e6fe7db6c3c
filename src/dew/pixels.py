"""The two pixel ranges Dew uses, and the one conversion each way between them.

Batches hold images as uint8 0..255; models see float32 in [-1, 1]. Objectives, metrics, trackers
and inference tasks all convert through these two functions, so an image reads back the same
wherever it is written.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def to_unit_range(images: Any) -> Any:
    """Images as float32 in [-1, 1] (a JAX array, traceable): uint8 maps 0 -> -1 and 255 -> 1;
    floats are taken to be in [-1, 1] already and only cast."""
    import jax.numpy as jnp

    images = jnp.asarray(images)
    if images.dtype == jnp.uint8:
        return images.astype(jnp.float32) / 127.5 - 1.0
    return images.astype(jnp.float32)


def to_uint8(images: Any) -> np.ndarray:
    """Images as host uint8 0..255: uint8 passes through; floats in [-1, 1] are clipped to that
    range, scaled and rounded to the nearest level."""
    images = np.asarray(images)
    if images.dtype == np.uint8:
        return images
    return np.round((np.clip(images.astype(np.float32), -1.0, 1.0) + 1.0) * 127.5).astype(np.uint8)


def png_bytes(image: Any) -> bytes:
    """One image [H, W, C] or [H, W] (uint8, or floats in [-1, 1]) encoded as PNG; a single channel
    is written as greyscale. Pair with `dew.files.write_atomic` to put it on disk."""
    import io

    from PIL import Image

    image = to_uint8(image)
    if image.ndim == 3 and image.shape[-1] == 1:
        image = image[..., 0]
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()
