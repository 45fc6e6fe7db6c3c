"""CLIP's byte-level BPE tokenizer built from vocab.json + merges.txt, the files diffusers pipelines ship.

Stable Diffusion repositories hold their CLIP tokenizers as vocab.json, merges.txt and
tokenizer_config.json, without the tokenizer.json a fast tokenizer reads. `clip_bpe(directory)`
builds the same `tokenizers.Tokenizer` transformers' CLIPTokenizer builds from those files:

    normalize   NFC, runs of whitespace -> " ", lowercase
    split       <|startoftext|>, <|endoftext|>, English contractions, letter runs, single digits,
                runs of other non-space characters; then byte-level symbols
    model       BPE with "</w>" closing each word, unknown symbols -> unk_token
    specials    bos, eos, unk and pad of tokenizer_config.json (each matched as a whole, never
                split, so SD 2.x / SDXL's pad "!" is its own id wherever it appears)
    wrap        <|startoftext|> ids <|endoftext|>
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
CONFIG_FILE = "tokenizer_config.json"
# transformers' CLIPTokenizer defaults, for the tokens a tokenizer_config.json leaves out
DEFAULT_TOKENS = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
                  "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def has_clip_bpe_files(directory: Path) -> bool:
    return (directory / VOCAB_FILE).is_file() and (directory / MERGES_FILE).is_file()


def _token(value: Any, field: str, where: Path) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise ValueError(f"{where} sets {field}={value!r}; expected a token string (or an AddedToken dict)")
    return value


def _merges(path: Path) -> list[tuple[str, str]]:
    """merges.txt: a "#version" line, then one "left right" pair per line, highest priority first."""
    merges = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or (number == 1 and line.startswith("#version")):
            continue
        pair = line.split(" ")
        if len(pair) != 2:
            raise ValueError(f"{path} line {number} is {line!r}; each merge is two symbols separated by one space")
        merges.append((pair[0], pair[1]))
    return merges


def clip_bpe(directory: str | Path) -> tuple[Any, dict[str, Any]]:
    """The `tokenizers.Tokenizer` of a CLIPTokenizer folder, and its tokenizer_config.json (the
    special tokens filled in with CLIP's defaults)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    directory = Path(directory)
    if not has_clip_bpe_files(directory):
        present = sorted(path.name for path in directory.iterdir())[:12] if directory.is_dir() else []
        raise FileNotFoundError(
            f"{directory} is not a CLIP tokenizer folder: it needs {VOCAB_FILE} and {MERGES_FILE} and holds {present}"
        )
    config_path = directory / CONFIG_FILE
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    for field, default in DEFAULT_TOKENS.items():
        config[field] = _token(config.get(field, default), field, config_path)
    vocab = json.loads((directory / VOCAB_FILE).read_text(encoding="utf-8"))
    missing = [config[field] for field in DEFAULT_TOKENS if config[field] not in vocab]
    if missing:
        raise ValueError(f"{config_path} names special tokens {missing} that {directory / VOCAB_FILE} does not hold")

    tokenizer = Tokenizer(BPE(vocab=vocab, merges=_merges(directory / MERGES_FILE), dropout=None,
                              continuing_subword_prefix="", end_of_word_suffix="</w>", fuse_unk=False,
                              unk_token=config["unk_token"]))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    specials = dict.fromkeys(config[field] for field in ("pad_token", "bos_token", "eos_token", "unk_token"))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    tokenizer.post_processor = processors.RobertaProcessing(
        (config["eos_token"], vocab[config["eos_token"]]), (config["bos_token"], vocab[config["bos_token"]]),
        trim_offsets=False, add_prefix_space=False)
    return tokenizer, config
