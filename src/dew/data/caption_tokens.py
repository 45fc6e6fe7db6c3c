"""Captions to the fixed-length token rows a text encoder reads.

`CaptionTokens(tokenizer, max_length)` encodes with the tokenizer's own special tokens (CLIP's
start and end of text, T5's closing ``</s>``), cuts a caption that is too long to ``max_length``
keeping those tokens, and pads with the tokenizer's pad id: the rows transformers' tokenizer gives
with ``padding="max_length", truncation=True``. A caption that does not fit is cut with a warning,
or refused with ``truncate=False``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dew.checks import count
from dew.data.tokenizers import HFTokenizer


class CaptionTokens:
    """Strings -> ``(ids, mask)``, both int32 [len(texts), max_length]; mask 1 = token, 0 = padding."""

    def __init__(self, tokenizer: HFTokenizer | str | Path, max_length: int, *, truncate: bool = True):
        self.tokenizer = tokenizer if isinstance(tokenizer, HFTokenizer) else HFTokenizer(tokenizer)
        self.max_length = count(max_length, "max_length")
        self.truncate = truncate
        if self.tokenizer.pad_id is None:
            raise ValueError(
                f"{self.tokenizer!r} names no pad or end-of-text token, so captions cannot be padded to "
                f"max_length={max_length}; set pad_token in its tokenizer_config.json"
            )
        self._rust = self.tokenizer.backend
        self._rust.no_padding()
        self._rust.enable_truncation(self.max_length)
        self._rust.enable_padding(length=self.max_length, pad_id=self.tokenizer.pad_id,
                                  pad_token=self.tokenizer.id_to_token(self.tokenizer.pad_id))

    def __call__(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(texts, str) or not all(isinstance(text, str) for text in texts):
            raise TypeError(f"CaptionTokens takes a sequence of strings; got {type(texts).__name__}")
        encodings = self._rust.encode_batch(list(texts), add_special_tokens=True)
        cut = [text for text, encoding in zip(texts, encodings) if encoding.overflowing]
        if cut:
            message = (f"{len(cut)} caption(s) need more than max_length={self.max_length} tokens, e.g. "
                       f"{cut[0][:60]!r}")
            if not self.truncate:
                raise ValueError(f"{message}; shorten them, raise max_length, or pass truncate=True to cut them")
            warnings.warn(f"{message}; they are cut to fit", stacklevel=2)
        ids = np.asarray([encoding.ids for encoding in encodings], np.int32).reshape(len(texts), self.max_length)
        mask = np.asarray([encoding.attention_mask for encoding in encodings], np.int32).reshape(ids.shape)
        return ids, mask

    def __repr__(self) -> str:
        return f"CaptionTokens({self.tokenizer!r}, max_length={self.max_length}, truncate={self.truncate})"
