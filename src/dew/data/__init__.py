"""Data loading: datasets of batch factories, Grain settings, token and image readers.

Names resolve on first use, so importing `dew.data` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Batch": "dew.data.dataset",
    "Dataset": "dew.data.dataset",
    "Loading": "dew.data.dataset",
    "Partition": "dew.data.dataset",
    "Role": "dew.data.chat",
    "ChatMessages": "dew.data.chat_messages",
    "PreferencePairs": "dew.data.preference",
    "Prompts": "dew.data.prompts",
    "ByteTokenizer": "dew.data.tokenizers",
    "HFTokenizer": "dew.data.tokenizers",
    "Tokenizer": "dew.data.tokenizers",
    "load_tokenizer": "dew.data.tokenizers",
    "TokenCorpus": "dew.data.tokens",
    "TokenWindows": "dew.data.tokens",
    "tokenize": "dew.data.tokens",
    "Digits": "dew.data.images",
    "ImageFolder": "dew.data.images",
    "TFDSImages": "dew.data.images",
    "VideoFrames": "dew.data.video",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dew.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
