"""Data loading: datasets of batch factories, Grain settings, token and image readers.

Names resolve on first use, so importing `dew.data` stays cheap.
"""

from __future__ import annotations

from dew._lazy import lazy_getattr

_EXPORTS = {
    "Batch": "dew.data.dataset",
    "Dataset": "dew.data.dataset",
    "Loading": "dew.data.dataset",
    "Partition": "dew.data.dataset",
    "Role": "dew.data.chat",
    "help_topics_text": "dew.data.corpora",
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


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
