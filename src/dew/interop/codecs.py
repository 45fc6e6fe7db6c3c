"""Quantized checkpoint tensors: MXFP4, as GPT-OSS's released expert kernels are stored.

MXFP4 (OCP Microscaling v1.0) stores a kernel ``[..., in, out]`` transposed, as ``out`` rows of
``in / 32`` blocks: each block is 32 FP4 (E2M1) codes packed two to a byte, the even element in
the low nibble, in ``*_blocks [..., out, in / 32, 16]`` (uint8), and one power-of-two scale, an
E8M0 exponent biased by 127, in ``*_scales [..., out, in / 32]`` (uint8). A value is
``FP4_VALUES[code] * 2 ** (scale - 127)``, exactly what transformers' ``convert_moe_packed_tensors``
computes, and exact in float32.

Encoding follows the rule of the tool that wrote the release, triton_kernels' ``downcast_to_mxfp``
(the quantizer transformers calls): a block's scale is ``max |value| / 6`` in float32 rounded up
to a power of two (so the largest magnitude fits FP4's largest, 6), and each value divided by it
goes to the nearest FP4 value, a tie to the one farther from zero. A block's exponent is
ambiguous once decoded (a block whose largest code is 3 also fits the next smaller scale), so
``quantize_packed_mxfp4`` takes the scales the tensor was read with and keeps a block's old
exponent whenever the block still holds exactly what it decoded to: weights saved unchanged get
back the bytes they were read from.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
FP4_MAX = 6.0
FP4_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)  # between neighbouring magnitudes
BLOCK = 32  # values per scale
SCALE_BIAS = 127
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def _check_packed(blocks: np.ndarray, scales: np.ndarray, name: str) -> None:
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 tensor {name!r} must be uint8 blocks and scales; got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 3 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 tensor {name!r} needs blocks [..., out, in / 32, 16] and scales [..., out, in / 32]; "
            f"got blocks {list(blocks.shape)} and scales {list(scales.shape)}"
        )


def dequantize_packed_mxfp4(blocks: Any, scales: Any, name: str = "tensor") -> np.ndarray:
    """The float32 kernel ``[..., in, out]`` that ``blocks [..., out, in / 32, 16]`` and
    ``scales [..., out, in / 32]`` encode (transformers' ``convert_moe_packed_tensors``)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    _check_packed(blocks, scales, name)
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # low nibble first
    values = FP4_VALUES[codes].reshape(*scales.shape, BLOCK)
    values = np.ldexp(values, (scales.astype(np.int32) - SCALE_BIAS)[..., None])
    return np.swapaxes(values.reshape(*scales.shape[:-1], -1), -1, -2)


def _exponents(values: np.ndarray) -> np.ndarray:
    """Each block's exponent: ``max |value| / 6`` in float32, its bits rounded up to a power of two
    (``downcast_to_mxfp``'s ROUND_UP), so ``max |value| <= 6 * 2 ** e`` (a zero block: -127)."""
    largest = np.max(np.abs(values), axis=-1).astype(np.float32)
    bits = (largest / np.float32(FP4_MAX)).view(np.int32).astype(np.int64)
    biased = ((bits + 0x007FFFFF) & 0x7F800000) >> 23
    return np.minimum(biased, 254).astype(np.int32) - SCALE_BIAS


def _codes(scaled: np.ndarray) -> np.ndarray:
    """The FP4 code nearest each value (a tie to the larger magnitude, past 6 the largest), with
    the value's sign bit."""
    codes = np.searchsorted(FP4_MIDPOINTS, np.abs(scaled), side="right")
    return (codes | (np.signbit(scaled) << 3)).astype(np.uint8)


def quantize_packed_mxfp4(values: Any, scales: Any = None, name: str = "tensor") -> tuple[np.ndarray, np.ndarray]:
    """``(blocks, scales)`` encoding the kernel ``values [..., in, out]`` (``in`` a multiple of 32).

    ``scales``: the ones the kernel was read with (optional); a block still exactly equal to what
    it decoded to keeps its exponent, so unchanged weights encode to the bytes they came from.
    """
    kernel = np.asarray(values, np.float32)
    if kernel.ndim < 2 or kernel.shape[-2] % BLOCK:
        raise ValueError(
            f"MXFP4 packs {name!r} in blocks of {BLOCK} along its input axis; its shape {list(kernel.shape)} "
            f"has {kernel.shape[-2] if kernel.ndim >= 2 else 'no'} inputs, not a multiple of {BLOCK}"
        )
    rows = np.swapaxes(kernel, -1, -2)
    grouped = rows.reshape(*rows.shape[:-1], rows.shape[-1] // BLOCK, BLOCK)
    exponents = _exponents(grouped)
    if scales is not None:
        old = np.asarray(scales)
        if old.shape != exponents.shape or old.dtype != np.uint8:
            raise ValueError(f"the scales given for {name!r} are {old.dtype} {list(old.shape)}; "
                             f"its blocks need uint8 {list(exponents.shape)}")
        old_exponents = old.astype(np.int32) - SCALE_BIAS
        at_old = np.ldexp(grouped, -old_exponents[..., None])
        exact = np.all(FP4_VALUES[_codes(at_old)] == at_old, axis=-1)
        exponents = np.where(exact, old_exponents, exponents)
    codes = _codes(np.ldexp(grouped, -exponents[..., None]))
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exponents + SCALE_BIAS).astype(np.uint8)


class DecodedCheckpoint(Mapping):
    """A checkpoint's tensors with every MXFP4 pair (``name_blocks``, ``name_scales``) shown as the
    one float32 tensor ``name`` it encodes, decoded when read. ``packed`` lists those names with
    the scales they were read with (for `quantize_packed_mxfp4`)."""

    def __init__(self, checkpoint: Any, where: str = "the checkpoint"):
        self.checkpoint = checkpoint
        blocks = {n.removesuffix(BLOCKS_SUFFIX) for n in checkpoint if n.endswith(BLOCKS_SUFFIX)}
        scales = {n.removesuffix(SCALES_SUFFIX) for n in checkpoint if n.endswith(SCALES_SUFFIX)}
        for lone, has, lacks in ((blocks - scales, BLOCKS_SUFFIX, SCALES_SUFFIX),
                                 (scales - blocks, SCALES_SUFFIX, BLOCKS_SUFFIX)):
            if lone:
                name = sorted(lone)[0]
                raise ValueError(
                    f"{where} holds the MXFP4 tensor {name + has!r} without {name + lacks!r} ({len(lone)} such); "
                    "a quantized tensor is decoded from its blocks and scales together, so the checkpoint is incomplete"
                )
        self.packed = sorted(blocks)
        self._names = [n for n in checkpoint if not n.endswith((BLOCKS_SUFFIX, SCALES_SUFFIX))] + self.packed

    def scales(self, name: str) -> np.ndarray:
        return np.asarray(self.checkpoint[name + SCALES_SUFFIX])

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.packed:
            return dequantize_packed_mxfp4(self.checkpoint[name + BLOCKS_SUFFIX], self.scales(name), name)
        return self.checkpoint[name]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.packed:
            *outer, out, groups, _ = self.checkpoint.shape(name + BLOCKS_SUFFIX)
            return (*outer, groups * BLOCK, out)
        return self.checkpoint.shape(name)

    def __contains__(self, name: object) -> bool:
        return name in self.packed or (name in self.checkpoint and not str(name).endswith((BLOCKS_SUFFIX, SCALES_SUFFIX)))

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def pack_mxfp4_tensors(tensors: Mapping[str, np.ndarray], names: Any,
                       scales: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """``tensors`` with each of ``names`` replaced by its ``name_blocks`` and ``name_scales``
    (``scales``: the ones each was read with, by name)."""
    out = dict(tensors)
    for name in names:
        if name not in out:
            raise ValueError(f"cannot pack {name!r} as MXFP4: the tensors hold no such name")
        blocks, packed_scales = quantize_packed_mxfp4(out.pop(name), (scales or {}).get(name), name)
        out[name + BLOCKS_SUFFIX], out[name + SCALES_SUFFIX] = blocks, packed_scales
    return out
