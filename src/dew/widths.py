"""Padded widths for token rows, shared by every layer that pads prompts to a few lengths so new
lengths rarely compile a new program (generation, guided decoding, the Server, evaluation)."""

from __future__ import annotations


def padded_width(length: int, limit: int, *, steps: int = 1) -> int:
    """The padded width for a longest row of `length` tokens: the next power of two (at least 8),
    capped at `limit`.

    ``steps`` (1, 2, 4, ...) splits each doubling into that many even widths: 2 adds 1.5 times each
    power of two (12, 24, 48, ...), so less than a third of a width is padding instead of half; 4
    adds 1.25, 1.5 and 1.75 times (80, 96, 112, 128, 160, ...), less than a fifth, in four times the
    programs. A server prefilling prompt after prompt takes the finer widths, since it compiles each
    width once and pays for the padding at every prompt.
    """
    width = max(8, 1 << (length - 1).bit_length())
    step = width // (2 * steps)
    if width > 8 and step:
        width = width // 2 + -(-(length - width // 2) // step) * step
    return min(width, limit)


__all__ = ["padded_width"]
