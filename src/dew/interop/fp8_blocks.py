"""FP8 block-quantized weights, the format DeepSeek-V3 and Kimi K2 are released in.

A quantized linear weight ``W [out, in]`` is stored as ``float8_e4m3fn`` values ``Q`` beside
``W_scale_inv [ceil(out / b0), ceil(in / b1)]`` (float32), one scale per ``b0 x b1`` block
(``weight_block_size`` in config.json's ``quantization_config``, 128 x 128 in the releases). The
weight is ``Q * scale`` block by block, one float32 product per element, which is how transformers
dequantizes it (``Fp8Dequantize``), so the float32 values are exact. A last block that the
dimensions cut short uses its scale for the elements it has.

Writing goes the other way: ``Q = fp8(W / scale)``. Each block keeps the scale it was read with
while ``|W / scale|`` fits the format's range (448), so an untrained weight is written back byte
for byte; a block that outgrew it, or a weight that had no scale, gets ``amax / 448``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
SCALE_SUFFIX = "_scale_inv"  # "....weight" -> "....weight_scale_inv"
METHOD = "fp8"  # quantization_config.quant_method
SUPPORTED = {"fmt": ("e4m3", None), "activation_scheme": ("dynamic", None)}


@dataclass(frozen=True)
class BlockQuantization:
    """The block size of a checkpoint's FP8 weights (rows, columns of ``W [out, in]``)."""

    block: tuple[int, int] = (128, 128)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "BlockQuantization | None":
        """The FP8 blocks a config.json declares (None: no FP8 quantization), raising on FP8 settings
        Dew cannot read. Another ``quant_method`` is left to the family to accept or refuse."""
        settings = config.get("quantization_config")
        if not settings or settings.get("quant_method") != METHOD:
            return None
        for key, supported in SUPPORTED.items():
            if settings.get(key) not in supported:
                raise ValueError(
                    f"config.json's quantization_config sets {key}={settings.get(key)!r}; Dew reads FP8 "
                    f"with {key} in {[s for s in supported if s is not None]} (e4m3 weight blocks with "
                    "weight_scale_inv, as DeepSeek-V3 ships). Dequantize the checkpoint first"
                )
        block = settings.get("weight_block_size") or (128, 128)
        if len(block) != 2 or any(int(b) < 1 for b in block):
            raise ValueError(f"quantization_config.weight_block_size must be two positive sizes, got {block!r}")
        return cls(block=(int(block[0]), int(block[1])))


def _blockwise(scale: np.ndarray, block: tuple[int, int], shape: tuple[int, ...]) -> np.ndarray:
    """Per-block values ``[..., ceil(rows / b0), ceil(cols / b1)]`` spread over ``shape``'s elements."""
    rows, cols = shape[-2:]
    spread = np.repeat(np.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return spread[..., :rows, :cols]


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    rows, cols = shape[-2:]
    return tuple(shape[:-2]) + (-(-rows // block[0]), -(-cols // block[1]))


def dequantize(values: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str = "weight") -> np.ndarray:
    """``values * scale_inv`` block by block, in float32."""
    if values.dtype != FP8:
        raise ValueError(f"{name} has dtype {values.dtype}; FP8 block weights are float8_e4m3fn")
    want = scale_shape(values.shape, block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"{name}{SCALE_SUFFIX} has shape {list(scale_inv.shape)}, but {name} {list(values.shape)} in "
            f"{list(block)} blocks needs {list(want)}; check weight_block_size in quantization_config"
        )
    return values.astype(np.float32) * _blockwise(np.asarray(scale_inv, np.float32), block, values.shape)


def quantize(weight: np.ndarray, block: tuple[int, int],
             scale_inv: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(values, scale_inv)`` for a float weight, keeping each block's given scale where it still fits."""
    weight = np.asarray(weight, np.float32)
    rows, cols = weight.shape[-2:]
    grid = scale_shape(weight.shape, block)
    padded = np.zeros(grid[:-2] + (grid[-2] * block[0], grid[-1] * block[1]), np.float32)
    padded[..., :rows, :cols] = np.abs(weight)
    blocks = padded.reshape(grid[:-2] + (grid[-2], block[0], grid[-1], block[1]))
    amax = blocks.max(axis=(-3, -1))
    fresh = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    if scale_inv is None:
        scale = fresh
    else:
        scale = np.asarray(scale_inv, np.float32)
        if scale.shape != grid:
            raise ValueError(f"scale_inv has shape {list(scale.shape)}, but {list(weight.shape)} in {list(block)} "
                             f"blocks needs {list(grid)}")
        fits = (scale > 0) & (amax / np.where(scale > 0, scale, 1) <= FP8_MAX)
        scale = np.where(fits, scale, fresh).astype(np.float32)
    ratio = weight / _blockwise(scale, block, weight.shape)
    return np.clip(ratio, -FP8_MAX, FP8_MAX).astype(FP8), scale
