"""Text tokenizers: raw UTF-8 bytes, and Hugging Face `tokenizers` files from a local directory.

Both follow one small protocol (`Tokenizer`): `encode`, `decode`, `vocab_size`, the special ids
(`eos_id`, `bos_id`, `pad_id`, each an int or None), `chat_template`, `save(directory)`, and
`describe()`, a string that `load_tokenizer` turns back into the same tokenizer (`"byte"`, or the
directory holding the files). A corpus records that string in its `meta.json`.

Nothing here touches the network: a Hub name such as `"gpt2"` is refused with a message saying how
to get the files onto disk first.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dew.hub import is_repo_id, local_directory

BYTE = "byte"

# Files a Hugging Face tokenizer directory may hold that a reload (by Dew or by transformers) reads.
_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_TEMPLATE_FILE = "chat_template.jinja"
_MARKER_FILE = "dew_tokenizer.json"  # what ByteTokenizer.save writes


@runtime_checkable
class Tokenizer(Protocol):
    """What Dew needs from a tokenizer."""

    vocab_size: int
    eos_id: int | None
    bos_id: int | None
    pad_id: int | None
    chat_template: str | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int] | np.ndarray) -> str: ...

    def save(self, directory: str | Path) -> Path: ...

    def describe(self) -> str: ...


def _id_list(ids: Iterable[int] | np.ndarray) -> list[int]:
    """Token ids as a flat list of Python ints (accepts lists, tuples and NumPy or JAX arrays)."""
    array = np.asarray(ids)
    if array.ndim != 1:
        raise ValueError(
            "decode takes one sequence of token ids (a 1-D array or list); got shape "
            f"{array.shape}. Decode a batch row by row."
        )
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"decode takes integer token ids; got dtype {array.dtype}.")
    return array.astype(np.int64).tolist()


class ByteTokenizer:
    """Text as its UTF-8 bytes: ids 0-255, nothing to train and nothing to download.

    There is no spare id for an end-of-document marker, so the NUL byte (id 0), which text files do
    not contain, plays that part: `eos_id` and `pad_id` are both 0, `decode` drops it, and
    `tokenize(..., pack=True)` writes it between documents. A text that does contain NUL loses
    those characters in a round trip.
    """

    vocab_size = 256
    eos_id = 0
    bos_id = None
    pad_id = 0
    chat_template = None

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Bytes back to text, dropping padding; a character cut short decodes to U+FFFD."""
        values = _id_list(ids)
        bad = [value for value in values if not 0 <= value < 256]
        if bad:
            raise ValueError(f"ByteTokenizer ids lie in [0, 256); got {bad[:5]}.")
        return bytes(value for value in values if value != self.pad_id).decode("utf-8", "replace")

    def save(self, directory: str | Path) -> Path:
        """Write `dew_tokenizer.json`, a marker `load_tokenizer(directory)` rebuilds it from."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / _MARKER_FILE).write_text(json.dumps({"tokenizer": BYTE}, indent=2) + "\n")
        return directory

    def describe(self) -> str:
        return BYTE

    def __repr__(self) -> str:
        return "ByteTokenizer()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteTokenizer)

    def __hash__(self) -> int:
        return hash(ByteTokenizer)


# the files a tokenizer directory may hold, fetched from a Hub repository without its weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class HFTokenizer:
    """A Hugging Face fast tokenizer read from a directory holding `tokenizer.json`, or from a Hub
    repository id through the Hugging Face cache (`revision`: a branch, tag or commit).

    `tokenizer_config.json`, when present, names the eos/bos/pad tokens and may carry a chat
    template; a `chat_template.jinja` file beside it takes precedence, as in transformers. When the
    config names no pad token, `pad_id` falls back to `eos_id`.
    """

    def __init__(self, name_or_dir: str | Path, *, revision: str | None = None, backend: Any = None,
                 config: dict[str, Any] | None = None):
        """``backend`` (a `tokenizers.Tokenizer`) and ``config`` stand in for the directory's
        tokenizer.json and tokenizer_config.json when it holds other files (CLIP's vocab.json +
        merges.txt, see `dew.data.clip_bpe`)."""
        directory = local_directory(name_or_dir, revision=revision, allow_patterns=TOKENIZER_FILES, what="tokenizer")
        if backend is None and not (directory / "tokenizer.json").is_file():
            present = sorted(path.name for path in directory.iterdir())[:10]
            raise FileNotFoundError(
                f"HFTokenizer needs {directory / 'tokenizer.json'} (a fast tokenizer file); the "
                f"directory holds {present}. Save the tokenizer with transformers' save_pretrained "
                "or copy its tokenizer.json there."
            )
        from tokenizers import Tokenizer as _RustTokenizer

        self.directory = directory.resolve()
        self._tokenizer = backend if backend is not None else _RustTokenizer.from_file(str(directory / "tokenizer.json"))
        config_path = directory / "tokenizer_config.json"
        self.config: dict[str, Any] = dict(config or {})
        if config is None and config_path.is_file():
            self.config = json.loads(config_path.read_text())

        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.pad_token = _token_text(self.config.get("pad_token"))
        self.eos_id = self._special_id(self.eos_token, "eos_token")
        self.bos_id = self._special_id(self.bos_token, "bos_token")
        pad_id = self._special_id(self.pad_token, "pad_token")
        self.pad_id = self.eos_id if pad_id is None else pad_id

        template_path = directory / _TEMPLATE_FILE
        if template_path.is_file():
            self.chat_template: str | None = template_path.read_text()
        else:
            self.chat_template = _config_template(self.config.get("chat_template"))

    def _special_id(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        index = self._tokenizer.token_to_id(token)
        if index is None:
            raise ValueError(
                f"tokenizer_config.json in {self.directory} names {field}={token!r}, which is not "
                "in the vocabulary of tokenizer.json."
            )
        return index

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token text in it (`<|endoftext|>`) maps to its id.

        `add_special_tokens=True` also applies the tokenizer's post-processor (a BOS, for some
        families); the default leaves the ids as the text spells them.
        """
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: list[str], *, add_special_tokens: bool = False
    ) -> list[list[int]]:
        """`encode` over many texts at once (in parallel, in Rust)."""
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Iterable[int] | np.ndarray, *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`, dropping padding; other special tokens stay unless asked to skip them.

        A BPE that marks word ends (CLIP's ``</w>``) has them turned back into spaces, as
        transformers' CLIPTokenizer does, since its saved decoder keeps them.
        """
        values = _id_list(ids)
        if self.pad_id is not None:
            values = [value for value in values if value != self.pad_id]
        text = self._tokenizer.decode(values, skip_special_tokens=skip_special_tokens)
        word_end = getattr(self._tokenizer.model, "end_of_word_suffix", None)
        return text.replace(word_end, " ").strip() if word_end else text

    @property
    def backend(self) -> Any:
        """A copy of the `tokenizers.Tokenizer`, to set padding or truncation on without touching this one."""
        from tokenizers import Tokenizer as _RustTokenizer

        return _RustTokenizer.from_str(self._tokenizer.to_str())

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, index: int) -> str | None:
        return self._tokenizer.id_to_token(index)

    def save(self, directory: str | Path) -> Path:
        """Copy the files that rebuild this tokenizer (tokenizer.json, tokenizer_config.json, and
        chat_template.jinja when there is a template) into `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in _HF_FILES:
            source = self.directory / name
            if source.is_file() and source.resolve() != (directory / name).resolve():
                shutil.copyfile(source, directory / name)
        if not (self.directory / "tokenizer.json").is_file():  # built from other files: write what they make
            self._tokenizer.save(str(directory / "tokenizer.json"))
        if not (self.directory / "tokenizer_config.json").is_file():
            config = {"tokenizer_class": "PreTrainedTokenizerFast"}
            for field in ("eos_token", "bos_token", "pad_token"):
                if getattr(self, field) is not None:
                    config[field] = getattr(self, field)
            (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        if self.chat_template is not None:
            (directory / _TEMPLATE_FILE).write_text(self.chat_template)
        return directory

    def describe(self) -> str:
        return str(self.directory)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.directory)!r})"


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"A special token in tokenizer_config.json must be a string; got {value!r}.")


def _config_template(value: Any) -> str | None:
    """The chat template in tokenizer_config.json: a string, or a list of named templates."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        return named.get("default") or next(iter(named.values()), None)
    raise ValueError(f"chat_template in tokenizer_config.json must be a string; got {type(value)}.")


def load_tokenizer(spec: str | Path | Tokenizer) -> ByteTokenizer | HFTokenizer:
    """The tokenizer a spec names: `"byte"`, a local directory holding tokenizer.json (or the
    marker `ByteTokenizer.save` writes), or a Hub repository id read through the Hugging Face cache.

    A tokenizer object passes through unchanged, so callers can take either.
    """
    if isinstance(spec, (ByteTokenizer, HFTokenizer)):
        return spec
    if not isinstance(spec, (str, Path)) and isinstance(spec, Tokenizer):
        return spec  # another object following the protocol
    if isinstance(spec, str) and spec == BYTE:
        return ByteTokenizer()
    if isinstance(spec, (str, Path)) and Path(spec).expanduser().is_dir():
        directory = Path(spec).expanduser()
        marker = directory / _MARKER_FILE
        if marker.is_file() and not (directory / "tokenizer.json").is_file():
            if json.loads(marker.read_text()).get("tokenizer") == BYTE:
                return ByteTokenizer()
        return HFTokenizer(directory)
    if is_repo_id(spec):
        return HFTokenizer(spec)
    raise ValueError(
        f"Unknown tokenizer {spec!r}: expected {BYTE!r}, a local directory holding tokenizer.json, "
        "or a Hub repository id (owner/name) in the Hugging Face cache."
    )
