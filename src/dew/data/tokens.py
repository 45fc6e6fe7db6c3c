"""Token corpora: `tokenize` text into flat id files, `TokenCorpus` to open them, and `TokenWindows`
to read them as training batches.

A corpus is a directory in nanoGPT's layout:

    train.bin    token ids, back to back, uint16 (vocabularies up to 65,536) or uint32
    val.bin      the same, for the validation split: the first `val_fraction` of the token stream
    meta.json    vocab_size, dtype, token counts, the tokenizer, and eos_id for packed corpora
    tokenizer/   a copy of a directory tokenizer's files, so the corpus rebuilds its tokenizer

Rows are windows of `seq_len + 1` consecutive ids: the model reads the first `seq_len` and predicts
the next id at each of them.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from dew.checks import count, count_fields
from dew.data.dataset import Batch, Dataset, Loading, Partition
from dew.data.tokenizers import BYTE, Tokenizer, load_tokenizer

META = "meta.json"
TOKENIZER_DIR = "tokenizer"
FORMAT = "dew.tokens"
VERSION = 1

_CHUNK_CHARS = 1 << 22  # characters read from the input at a time (a few MB of text in memory)
_COPY_BYTES = 1 << 24


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id: uint16 up to 65,536 ids, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


# ----------------------------------------------------------------------------------------------
# Writing a corpus


def tokenize(
    input: str | os.PathLike,
    out: str | os.PathLike,
    tokenizer: str | os.PathLike | Tokenizer = BYTE,
    *,
    val_fraction: float = 0.01,
    pack: bool = False,
    separator: str | None = None,
    progress: bool | None = None,
) -> TokenCorpus:
    """Tokenize the UTF-8 text file `input` into a corpus directory `out`, and open it.

    The input is read a few MB at a time and cut where a line break follows visible text (a
    GPT-2-style byte-level tokenizer gives the same ids for the pieces as for the whole), so memory
    stays flat for any file size. Ids are
    written to temporary files first and renamed into place at the end: a failure leaves `out`
    as it was.

    `pack=True` treats the input as documents and ends each one with the tokenizer's EOS id, which
    meta.json records for `TokenWindows(pack=True)`. Documents are the pieces of the input between
    occurrences of `separator`, by default the EOS token's own text where it has one
    (`<|endoftext|>`, as TinyStories writes it) and a blank line ("\\n\\n") for the byte tokenizer;
    line breaks around each piece are trimmed and empty pieces skipped. Without `pack`, text is
    tokenized as it stands (an `<|endoftext|>` in it still becomes the EOS id).

    `progress` prints bytes read and tokens written to stderr; by default only on a terminal.
    """
    input, out = Path(input), Path(out)
    if not input.is_file():
        raise FileNotFoundError(f"tokenize reads a UTF-8 text file; {str(input)!r} is not a file.")
    if not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise ValueError(
            f"val_fraction is the share of tokens held out for validation, in [0, 1); got "
            f"{val_fraction!r}."
        )
    tok = load_tokenizer(tokenizer)
    if pack:
        if tok.eos_id is None:
            raise ValueError(
                f"pack=True ends every document with an EOS id, and {tok!r} has none; name an "
                "eos_token in its tokenizer_config.json or tokenize without pack."
            )
        if separator is None:
            separator = getattr(tok, "eos_token", None) or "\n\n"
        if not separator:
            raise ValueError("separator must be a non-empty string.")
    dtype = token_dtype(tok.vocab_size)
    show = sys.stderr.isatty() if progress is None else progress

    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    stream, train_tmp, val_tmp, meta_tmp, tok_tmp = (
        out / f".{name}{tag}" for name in ("tokens", "train.bin", "val.bin", META, TOKENIZER_DIR)
    )
    try:
        with open(stream, "wb") as sink:
            total, documents = _write_ids(input, sink, tok, dtype, pack, separator, show)
        if total == 0:
            raise ValueError(f"{input} holds no text to tokenize.")
        val_tokens = int(total * val_fraction)
        _split(stream, val_tmp, train_tmp, val_tokens * dtype.itemsize)
        stream.unlink()

        spec = tok.describe()
        if spec != BYTE:
            tok.save(tok_tmp)
        meta: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "vocab_size": int(tok.vocab_size),
            "dtype": dtype.name,
            "train_tokens": total - val_tokens,
            "val_tokens": val_tokens,
            "val_fraction": float(val_fraction),
            "tokenizer": BYTE if spec == BYTE else TOKENIZER_DIR,
            "tokenizer_source": spec,
            "pack": bool(pack),
            "eos_id": int(tok.eos_id) if pack else None,
            "input": str(input),
        }
        if pack:
            meta.update(documents=documents, separator=separator)
        meta_tmp.write_text(json.dumps(meta, indent=2) + "\n")

        # meta.json marks a finished corpus: take the old one away first and put the new one last.
        (out / META).unlink(missing_ok=True)
        train_tmp.replace(out / "train.bin")
        val_tmp.replace(out / "val.bin")
        if (out / TOKENIZER_DIR).is_dir():
            shutil.rmtree(out / TOKENIZER_DIR)
        if tok_tmp.exists():
            tok_tmp.replace(out / TOKENIZER_DIR)
        meta_tmp.replace(out / META)
    except BaseException:
        for path in (stream, train_tmp, val_tmp, meta_tmp):
            path.unlink(missing_ok=True)
        shutil.rmtree(tok_tmp, ignore_errors=True)
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
    return TokenCorpus.read(out)


def _write_ids(input, sink, tok, dtype, pack, separator, show) -> tuple[int, int]:
    """Tokenize `input` piece by piece into `sink`; returns (tokens written, documents)."""
    encode_batch = getattr(tok, "encode_batch", None)
    if encode_batch is None:
        encode_batch = lambda texts: [tok.encode(text) for text in texts]  # noqa: E731
    limit = np.iinfo(dtype).max
    total = documents = 0
    size = input.stat().st_size
    started = time.monotonic()

    def write(ids: list[int]):
        nonlocal total
        array = np.asarray(ids, dtype=np.int64)
        if array.size and (array.min() < 0 or array.max() >= tok.vocab_size or array.max() > limit):
            raise ValueError(
                f"{tok!r} produced id {int(array.max())}, outside its vocabulary of "
                f"{tok.vocab_size}."
            )
        array.astype(dtype).tofile(sink)
        total += array.size

    with open(input, "rb") as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8", newline="")
        for final, pieces in _pieces(text, input, separator if pack else None):
            if pack:
                docs = [doc.strip("\r\n") for doc in pieces]
                docs = [doc for doc in docs if doc]
                documents += len(docs)
                for ids in encode_batch(docs):
                    ids.append(tok.eos_id)
                    write(ids)
            else:
                for ids in encode_batch(pieces):
                    write(ids)
            if show:
                done = size if final else raw.tell()
                rate = done / max(time.monotonic() - started, 1e-9) / 1e6
                print(
                    f"\rtokenize: {done / 1e6:,.1f}/{size / 1e6:,.1f} MB, {total:,} tokens, "
                    f"{rate:,.1f} MB/s",
                    end="\n" if final else "",
                    file=sys.stderr,
                    flush=True,
                )
    return total, documents


def _pieces(text, input, separator: str | None) -> Iterator[tuple[bool, list[str]]]:
    """Yield (last?, texts) from a text stream in pieces safe to tokenize apart.

    With a separator the texts are whole documents; without, they are runs of lines (`_line_cut`).
    """
    carry = ""
    while True:
        try:
            chunk = text.read(_CHUNK_CHARS)
        except UnicodeDecodeError as error:
            raise ValueError(f"{input} is not UTF-8 text: {error}.") from None
        if not chunk:
            break
        buffer = carry + chunk
        if separator is not None:
            *whole, carry = buffer.split(separator)
            if whole:
                yield False, whole
            continue
        cut = _line_cut(buffer)
        if cut == 0 and len(buffer) >= 16 * _CHUNK_CHARS:
            cut = len(buffer)  # one enormous line: cut it anyway
        if cut:
            yield False, [buffer[:cut]]
        carry = buffer[cut:]
    yield True, [carry]


def _line_cut(buffer: str) -> int:
    """Where to cut `buffer`: before the whitespace run holding its last newline, if visible text
    precedes it (0 when there is no such place).

    A GPT-2-style pre-tokenizer ends every piece at such a boundary and tokenizes a whitespace run
    by what follows it, so the two sides tokenize the same apart as together.
    """
    newline = buffer.rfind("\n")
    while newline > 0 and buffer[newline - 1].isspace():
        newline -= 1
    return max(newline, 0)


def _split(stream: Path, head: Path, rest: Path, head_bytes: int):
    """Copy the first `head_bytes` of `stream` to `head` and the remainder to `rest`."""
    with open(stream, "rb") as source:
        with open(head, "wb") as sink:
            left = head_bytes
            while left:
                block = source.read(min(left, _COPY_BYTES))
                sink.write(block)
                left -= len(block)
        with open(rest, "wb") as sink:
            shutil.copyfileobj(source, sink, _COPY_BYTES)


# ----------------------------------------------------------------------------------------------
# Reading a corpus


@dataclasses.dataclass(frozen=True, eq=False)
class TokenCorpus:
    """A tokenized corpus opened for reading: the splits as read-only memory maps, and its meta."""

    directory: Path
    meta: dict[str, Any]
    train: np.ndarray
    val: np.ndarray

    @classmethod
    def read(cls, directory: str | os.PathLike) -> TokenCorpus:
        directory = Path(directory)
        hint = f"write one with `dew tokenize --input TEXT --out {directory}`"
        if not directory.is_dir():
            raise FileNotFoundError(
                "Expected a token directory (train.bin, val.bin, meta.json) at "
                f"{str(directory)!r}; it does not exist. {hint[0].upper()}{hint[1:]}."
            )
        meta_path = directory / META
        if not meta_path.is_file():
            present = sorted(path.name for path in directory.iterdir())[:10]
            raise FileNotFoundError(
                f"Expected {meta_path} beside train.bin and val.bin; the directory holds "
                f"{present}. It is not a finished token corpus: {hint}."
            )
        meta = json.loads(meta_path.read_text())
        required = ("vocab_size", "dtype", "train_tokens", "val_tokens")
        missing = [key for key in required if key not in meta]
        if missing:
            raise ValueError(f"{meta_path} lacks {missing}; {hint}.")
        dtype = np.dtype(meta["dtype"])
        splits = {name: _open_split(directory, name, dtype, meta) for name in ("train", "val")}
        return cls(directory=directory, meta=meta, **splits)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    @property
    def eos_id(self) -> int | None:
        """The id that ends each document in a packed corpus; None when not tokenized with pack."""
        return self.meta.get("eos_id")

    @property
    def tokenizer(self) -> str:
        """What rebuilds the tokenizer: `"byte"`, or the path of the copied tokenizer directory
        (pass either to `load_tokenizer`; the path also to `HFTokenizer`)."""
        spec = self.meta.get("tokenizer", BYTE)
        if spec == BYTE:
            return BYTE
        return str((self.directory / spec).resolve())

    def __repr__(self) -> str:
        return (
            f"TokenCorpus({str(self.directory)!r}, train={len(self.train):,}, "
            f"val={len(self.val):,}, vocab_size={self.vocab_size}, "
            f"tokenizer={self.meta.get('tokenizer_source', BYTE)!r})"
        )


def _open_split(directory: Path, name: str, dtype: np.dtype, meta: dict) -> np.ndarray:
    path = directory / f"{name}.bin"
    if not path.is_file():
        raise FileNotFoundError(f"Expected {path} (listed in {directory / META}); it is missing.")
    expected = int(meta[f"{name}_tokens"])
    actual = path.stat().st_size / dtype.itemsize
    if actual != expected:
        raise ValueError(
            f"{path} holds {actual:g} {dtype.name} ids but meta.json says {expected}; the corpus "
            "is damaged or was written by another tool. Tokenize it again."
        )
    if expected == 0:
        return np.zeros(0, dtype)  # an empty file cannot be memory-mapped
    return np.memmap(path, dtype=dtype, mode="r")


# ----------------------------------------------------------------------------------------------
# Reading windows


@dataclasses.dataclass(frozen=True)
class TokenWindows:
    """Rows of `seq_len + 1` consecutive ids cut from a corpus that `tokenize` wrote.

    Training rows come from the windows `offset + k * seq_len` of train.bin (neighbours share one
    id, so every id is a target exactly once an epoch). Each epoch visits every window once in a
    fresh order, and moves all windows by a fresh offset, both drawn from `seed`. Validation reads
    val.bin's windows once, in order, from offset 0; ids past the last whole window are left out.

    `pack=True` (for a corpus tokenized with `pack=True`) adds `segment_ids` and `positions`. A
    document ends with its EOS id; a row holding parts of several documents numbers them 1, 2, ...
    and restarts `positions` at 0 where each begins. A document that crosses a row boundary is split
    there, and its part in the next row starts at position 0 as a new segment, so no id is dropped
    and no row needs padding (segment id 0, kept for padding, does not occur).

    `path` may be None so the record can stand in a config before the data exists; `load` needs it.
    """

    path: str | None = None
    seq_len: int = 256
    pack: bool = False
    seed: int = 0
    loading: Loading = Loading()

    def __post_init__(self):
        count_fields(self, seq_len=1, seed=0)
        if not isinstance(self.loading, Loading):
            raise TypeError(f"TokenWindows.loading must be a Loading; got {self.loading!r}.")

    def load(self, batch: int) -> Dataset:
        """A Dataset of global batches of `batch` rows: "text" (int32, seq_len + 1 ids) and, when
        packing, "segment_ids" and "positions" (int32, same shape)."""
        batch = count(batch, "TokenWindows.load batch")
        if self.path is None:
            raise ValueError(
                "TokenWindows.path is None; set it to a directory that `dew tokenize` wrote "
                "(train.bin, val.bin, meta.json)."
            )
        corpus = TokenCorpus.read(self.path)
        length = self.seq_len + 1
        eos_id = None
        if self.pack:
            eos_id = corpus.eos_id
            if eos_id is None:
                raise ValueError(
                    f"TokenWindows(pack=True) splits documents at the EOS id that a packed corpus "
                    f"records, and {corpus.directory / META} has none (eos_id is null); tokenize "
                    "again with pack=True (`dew tokenize --pack`), or read it with pack=False."
                )
        for name, split in (("train", corpus.train), ("val", corpus.val)):
            if len(split) < length and (name == "train" or len(split)):
                more = " (or a larger val_fraction; 0 for none)" if name == "val" else ""
                raise ValueError(
                    f"seq_len={self.seq_len} needs {length} ids a row, but {name}.bin in "
                    f"{corpus.directory} holds {len(split)}; lower seq_len or tokenize more "
                    f"text{more}."
                )

        windows = max(1, (len(corpus.train) - self.seq_len) // self.seq_len)
        slack = len(corpus.train) - 1 - windows * self.seq_len  # room to move the windows per epoch
        train_path = corpus.directory / "train.bin"
        seed, seq_len, loading = self.seed, self.seq_len, self.loading

        def train(partition: Partition = Partition()) -> Iterator[Batch]:
            import grain

            starts = (
                grain.MapDataset.range(windows)
                .shuffle(seed=seed)
                .repeat()
                .map_with_index(_WindowStart(windows, seq_len, slack, seed))
            )
            rows = _ReadRows(train_path, corpus.dtype, length, partition.rows(batch), eos_id)
            return iter(loading.apply(starts.batch(batch).map(rows)))

        val = None
        if len(corpus.val):
            val_windows = (len(corpus.val) - 1) // seq_len
            val_path = corpus.directory / "val.bin"

            def val(partition: Partition = Partition()) -> Iterator[Batch]:
                for first in range(0, val_windows, batch):
                    starts = np.arange(first, min(first + batch, val_windows)) * seq_len
                    if len(starts) % partition.count:
                        break  # a short last batch that does not split evenly over processes
                    rows = partition.rows(len(starts))
                    yield _ReadRows(val_path, corpus.dtype, length, rows, eos_id)(starts)

        return Dataset(train=train, val=val, records=windows, batch=batch)


class _WindowStart:
    """Grain map from (index in the repeated stream, window number) to the window's first id."""

    def __init__(self, windows: int, seq_len: int, slack: int, seed: int):
        self.windows, self.seq_len, self.slack, self.seed = windows, seq_len, slack, seed

    def __call__(self, index: int, window: int) -> int:
        return _epoch_offset(self.seed, index // self.windows, self.slack) + window * self.seq_len


@lru_cache(maxsize=64)
def _epoch_offset(seed: int, epoch: int, slack: int) -> int:
    if slack == 0:
        return 0
    return int(np.random.default_rng([seed, epoch]).integers(slack + 1))


class _ReadRows:
    """Grain map from a batch of window starts to this process's rows of the batch.

    The memory map opens lazily and is left out when pickled, so worker processes open their own.
    """

    def __init__(self, path: Path, dtype: np.dtype, length: int, rows: slice, eos_id: int | None):
        self.path, self.dtype, self.length = path, dtype, length
        self.rows, self.eos_id = rows, eos_id
        self._tokens = None

    def __getstate__(self):
        return {**self.__dict__, "_tokens": None}

    def __call__(self, starts: np.ndarray) -> Batch:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        starts = np.asarray(starts, dtype=np.int64)[self.rows]
        text = np.stack([self._tokens[start : start + self.length] for start in starts])
        text = text.astype(np.int32)
        if self.eos_id is None:
            return {"text": text}
        segment_ids, positions = document_segments(text, self.eos_id)
        return {"text": text, "segment_ids": segment_ids, "positions": positions}


def document_segments(text: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids (1, 2, ... per document in a row) and positions (from 0 in each document) for
    rows of a packed stream where `eos_id` ends a document; a new document begins after each EOS."""
    text = np.asarray(text)
    begins = np.zeros(text.shape, dtype=bool)
    begins[..., 0] = True
    begins[..., 1:] = text[..., :-1] == eos_id
    segment_ids = np.cumsum(begins, axis=-1, dtype=np.int32)
    index = np.broadcast_to(np.arange(text.shape[-1], dtype=np.int32), text.shape)
    last_begin = np.maximum.accumulate(np.where(begins, index, 0), axis=-1)
    return segment_ids, (index - last_begin).astype(np.int32)


def prompt_rows(prompts: Any) -> list[np.ndarray]:
    """Prompts as a list of 1-D integer arrays (a 2-D array is one prompt per row)."""
    if isinstance(prompts, np.ndarray) or (hasattr(prompts, "__array__") and hasattr(prompts, "ndim")):
        array = np.asarray(prompts)
        if array.ndim == 1:
            array = array[None]
        if array.ndim != 2:
            raise ValueError(
                f"prompts must be a list of token-id lists or a [batch, length] array, got shape {array.shape}"
            )
        rows = list(array)
    elif isinstance(prompts, (str, bytes)):
        raise TypeError(
            "generate takes token ids, not text; tokenize the prompt first (or use TextGeneration with a tokenizer)"
        )
    else:
        rows = [np.asarray(row) for row in prompts]
    if not rows:
        raise ValueError("prompts is empty: pass at least one prompt")
    for i, row in enumerate(rows):
        if row.ndim != 1:
            raise ValueError(f"prompt {i} must be a flat list of token ids, got shape {row.shape}")
        if row.size == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if not np.issubdtype(row.dtype, np.integer):
            raise ValueError(f"prompt {i} must hold integer token ids, got dtype {row.dtype}")
    return rows
