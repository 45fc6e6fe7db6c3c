"""Guided generation: draws kept inside a grammar (a JSON schema or a regular expression).

outlines-core compiles the grammar against the tokenizer's vocabulary into an automaton over token
ids (an `Index`): each state allows some tokens, and each allowed token leads to a next state.
`Grammar` holds that automaton with a boolean mask per state; `guided_generate` decodes one prompt,
masking each step's logits to the current state's tokens before the Sampling chooses, so the text
always matches the grammar (unless the budget ends it first). In a final state the EOS id is
allowed, and once nothing else is, the draw is forced to it.

The automaton works on bytes: `token_bytes` reads each token's bytes from the tokenizer (the
byte-level alphabet of GPT-2-style BPE, or a token's decoded text), leaving special tokens out.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.checks import count
from dew.sampling.text import Sampling, _row_keys, choose_tokens
from dew.widths import padded_width


def _outlines():
    try:
        import outlines_core
    except ImportError:
        raise ImportError("Guided generation needs outlines-core: pip install 'dewml[guided]'.") from None
    return outlines_core


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted (character -> byte)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    stand_ins, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            stand_ins[chr(byte)] = byte
        else:
            stand_ins[chr(256 + extra)] = byte
            extra += 1
    return stand_ins


def token_bytes(tokenizer: Any, vocab_size: int) -> dict[bytes, list[int]]:
    """The bytes each ordinary token stands for (special tokens and tokens without bytes left out)."""
    rust = getattr(tokenizer, "_tokenizer", None)
    pieces: dict[bytes, list[int]] = {}
    if rust is None:  # a byte tokenizer: id i is byte i
        for i in range(min(256, vocab_size)):
            pieces.setdefault(bytes([i]), []).append(i)
        return pieces
    special = {i for i, added in rust.get_added_tokens_decoder().items() if added.special}
    decoder = (json.loads(rust.to_str()).get("decoder") or {}).get("type")
    alphabet = _byte_level_alphabet()
    for i in range(vocab_size):
        token = rust.id_to_token(i)
        if token is None or i in special:
            continue
        if decoder == "ByteLevel" and all(c in alphabet for c in token):
            data = bytes(alphabet[c] for c in token)
        else:
            text = tokenizer.decode([i])
            if not text or "\ufffd" in text:
                continue
            data = text.encode("utf-8")
        pieces.setdefault(data, []).append(i)
    return pieces


class Grammar:
    """A token automaton: the tokens each state allows and the state each token leads to."""

    def __init__(self, index: Any, vocab_size: int, eos_id: int):
        self.index, self.vocab_size, self.eos_id = index, vocab_size, eos_id
        self.initial = index.get_initial_state()
        self._masks: dict[int, np.ndarray] = {}

    def mask(self, state: int) -> np.ndarray:
        """``[vocab_size]`` bool: the tokens `state` allows."""
        if state not in self._masks:
            allowed = np.zeros(self.vocab_size, bool)
            allowed[[t for t in self.index.get_allowed_tokens(state) if t < self.vocab_size]] = True
            self._masks[state] = allowed
        return self._masks[state]

    def advance(self, state: int, token: int) -> int:
        following = self.index.get_next_state(state, token)
        if following is None:
            raise ValueError(f"token {token} is not allowed in grammar state {state}.")
        return following


def regex(tokenizer: Any, pattern: str, eos_id: int, vocab_size: int | None = None) -> Grammar:
    """The grammar of texts matching `pattern`, over `tokenizer`'s tokens, ended by `eos_id`."""
    core = _outlines()
    vocab_size = int(vocab_size if vocab_size is not None else tokenizer.vocab_size)
    pieces = {data: ids for data, ids in token_bytes(tokenizer, vocab_size).items() if eos_id not in ids}
    try:
        index = core.Index(pattern, core.Vocabulary(int(eos_id), pieces))
    except Exception as error:  # outlines-core raises ValueError or its own errors for a bad pattern
        raise ValueError(f"outlines-core cannot compile this grammar over the tokenizer's vocabulary: {error}") from None
    return Grammar(index, vocab_size, int(eos_id))


def json_schema(tokenizer: Any, schema: Mapping[str, Any] | str, eos_id: int, vocab_size: int | None = None,
                whitespace: str | None = r"[ ]?") -> Grammar:
    """The grammar of JSON documents valid under `schema`. `whitespace` is the pattern allowed
    between tokens of the document (at most one space by default, so a document cannot run on in
    blank space; None: outlines-core's own)."""
    core = _outlines()
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        pattern = core.json_schema.build_regex_from_schema(text, whitespace)
    except Exception as error:
        raise ValueError(f"outlines-core cannot compile this JSON schema: {error}") from None
    return regex(tokenizer, pattern, eos_id, vocab_size)


# --- decoding one prompt under a grammar ---------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("model", "cache_len"))
def _prefill(variables, tokens, length, *, model, cache_len):
    cache = model.init_cache(1, cache_len)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    logits, cache = model.apply(variables, tokens, positions=positions, cache=cache,
                                logits_at=(length - 1)[:, None])  # the prompt's last token only
    logits = logits[:, 0]
    return logits, cache.truncate(length)


@functools.partial(jax.jit, static_argnames=("sampling",))
def _choose(logits, allowed, key, *, sampling):
    masked = jnp.where(allowed[None], logits, -jnp.inf)
    tokens, behavior, _ = choose_tokens(masked, key[None], sampling)
    return tokens[0], behavior[0]


@functools.partial(jax.jit, static_argnames=("model",))
def _feed(variables, token, cache, *, model):
    logits, cache = model.apply(variables, token.reshape(1, 1), cache=cache)
    return logits[:, 0], cache


def guided_generate(model: Any, variables: Any, prompt: Any, max_new_tokens: int, *, grammar: Grammar,
                    key: jax.Array, sampling: Sampling = Sampling()) -> tuple[list[int], list[float], bool]:
    """Continue one prompt by up to `max_new_tokens` tokens inside `grammar`.

    Returns the tokens drawn (the EOS token included when drawn), each one's log-probability under
    the masked distribution it was drawn from, and whether the grammar's EOS ended it. Step t draws
    with the key TextGeneration gives step t of this prompt alone (`fold_in(row_key, t)`).
    """
    budget = count(max_new_tokens, "max_new_tokens")
    ids = np.asarray(prompt, np.int32).reshape(-1)
    if ids.size + budget > model.max_seq_len:
        raise ValueError(f"the prompt's {ids.size} tokens plus max_new_tokens={budget} are more than the model's "
                         f"max_seq_len={model.max_seq_len}.")
    width = padded_width(ids.size, model.max_seq_len)
    padded = np.zeros((1, width), np.int32)
    padded[0, : ids.size] = ids
    logits, cache = _prefill(variables, jnp.asarray(padded), jnp.asarray([ids.size], jnp.int32), model=model,
                             cache_len=min(width + budget, model.max_seq_len))
    row_key = _row_keys(key, 1, 1)[0]
    state, tokens, logprobs = grammar.initial, [], []
    for t in range(budget):
        allowed = grammar.mask(state)
        if not allowed.any():
            raise ValueError(f"grammar state {state} allows no token; the grammar cannot continue this text.")
        token, logprob = _choose(logits, jnp.asarray(allowed), jax.random.fold_in(row_key, t), sampling=sampling)
        token = int(token)
        tokens.append(token)
        logprobs.append(float(logprob))
        if token == grammar.eos_id:
            return tokens, logprobs, True
        state = grammar.advance(state, token)
        if t + 1 < budget:
            logits, cache = _feed(variables, jnp.asarray(token, jnp.int32), cache, model=model)
    return tokens, logprobs, False
