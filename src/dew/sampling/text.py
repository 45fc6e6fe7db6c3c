"""Autoregressive text generation from a decoder with a KV cache.

`generate` prefills the cache with the prompts once, then draws one token per step inside a
`jax.lax.while_loop`, all under one `jax.jit`: a new token never recompiles, and neither do new
prompts of the same padded shape (prompt lengths are padded up to a power of two).

Ragged prompts are right-padded and every row keeps its own position: row b's next token sits at
position ``len(prompt_b) + t`` and cache slot ``s`` holds position ``s``, so padding is never
attended to and a row generates what it would generate alone. Randomness is per row: the key of
prompt i is ``fold_in(key, i)``, continuation j of it uses ``fold_in(prompt_key, j)``, and step t
draws with ``fold_in(row_key, t)``; so ``n=1`` reproduces continuation 0 of ``n=4``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the model's logits.

    Attributes:
      temperature: divides the logits; 0 takes the most likely token (greedy).
      top_k: keep the k most likely tokens (ties with the k-th kept too).
      top_p: keep the smallest set of most likely tokens whose probability reaches top_p.
      min_p: keep tokens whose probability is at least min_p times the top token's.
      eos_token_ids: a token id or ids that end a row (the EOS token is kept in the output).
      pad_id: written after a row ends.

    The filters apply in Hugging Face's order: temperature, top-k, top-p, min-p.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    eos_token_ids: int | Sequence[int] | None = ()
    pad_id: int = 0

    def __post_init__(self) -> None:
        eos = self.eos_token_ids
        if eos is None:
            eos = ()
        elif isinstance(eos, (int, np.integer)):
            eos = (int(eos),)
        else:
            eos = tuple(int(e) for e in eos)
        object.__setattr__(self, "eos_token_ids", eos)
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k is not None and (int(self.top_k) != self.top_k or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] or None, got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Generation:
    """What `generate` returns, one row per (prompt, continuation), prompt-major.

    Attributes:
      tokens: ``[rows, max_new_tokens]`` int32, the generated tokens only; pad_id after EOS.
      lengths: ``[rows]`` generated tokens per row, the EOS token included.
      terminated: ``[rows]`` True where the row produced an EOS token.
      behavior_log_probs: ``[rows, max_new_tokens]`` log-probability of each token under the
        distribution it was drawn from (after temperature/top-k/top-p/min-p; 0 for greedy).
      raw_log_probs: ``[rows, max_new_tokens]`` log-probability under the model's plain softmax.
      Both are 0 after a row ends.
    """

    tokens: jax.Array
    lengths: jax.Array
    terminated: jax.Array
    behavior_log_probs: jax.Array
    raw_log_probs: jax.Array

    def host(self) -> "Generation":
        """The same result as NumPy arrays on the host."""
        return jax.tree_util.tree_map(np.asarray, self)


# --- choosing a token ----------------------------------------------------------------------------


def process_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """Logits of the distribution `sampling` draws from (-inf where a token is filtered out).

    Needs ``sampling.temperature > 0``; greedy decoding does not sample.
    """
    x = logits.astype(jnp.float32) / jnp.float32(sampling.temperature)
    if sampling.top_k is not None and sampling.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, int(sampling.top_k))[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if sampling.top_p is not None and sampling.top_p < 1:
        ranked = jnp.sort(x, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(ranked, axis=-1)
        mass_above = jnp.cumsum(probs, axis=-1) - probs  # probability of strictly better-ranked tokens
        keep = mass_above < sampling.top_p  # the top token always qualifies
        threshold = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < threshold, -jnp.inf, x)
    if sampling.min_p is not None and sampling.min_p > 0:
        probs = jax.nn.softmax(x, axis=-1)
        floor = sampling.min_p * jnp.max(probs, axis=-1, keepdims=True)
        x = jnp.where(probs < floor, -jnp.inf, x)
    return x


def choose_tokens(logits: jax.Array, keys: jax.Array, sampling: Sampling):
    """Next tokens ``[rows]`` from logits ``[rows, vocab]``, with their behaviour and raw log-probs."""
    raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    if sampling.greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        behavior = jnp.zeros(tokens.shape, jnp.float32)  # a point mass
    else:
        processed = process_logits(logits, sampling)
        tokens = jax.vmap(jax.random.categorical)(keys, processed).astype(jnp.int32)
        behavior = _pick(jax.nn.log_softmax(processed, axis=-1), tokens)
    return tokens, behavior, _pick(raw, tokens)


def _pick(log_probs: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]


# --- the loop ------------------------------------------------------------------------------------


def _row_keys(key: jax.Array, num_prompts: int, n: int) -> jax.Array:
    """Key of continuation j of prompt i, at row i * n + j: fold_in(fold_in(key, i), j)."""
    fold = jax.vmap(jax.random.fold_in, in_axes=(None, 0))
    prompt_keys = fold(key, jnp.arange(num_prompts))
    keys = jax.vmap(fold, in_axes=(0, None))(prompt_keys, jnp.arange(n))
    return keys.reshape((num_prompts * n,) + keys.shape[2:])


def _generate(variables, prompt_tokens, prompt_lengths, key, *, model, sampling, max_new_tokens, n, cache_len):
    batch, prompt_len = prompt_tokens.shape
    rows = batch * n

    # prefill: the whole padded prompt at positions 0..P-1, then each row's length is its own
    cache = model.init_cache(batch, cache_len)
    positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    logits, cache = model.apply(variables, prompt_tokens, positions=positions, cache=cache)
    logits = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    cache = cache.truncate(prompt_lengths)  # forget the padding after short prompts
    if n > 1:
        cache, logits = cache.repeat(n), jnp.repeat(logits, n, axis=0)

    row_keys = _row_keys(key, batch, n)
    eos = jnp.asarray(sampling.eos_token_ids, jnp.int32)

    def keep_going(state):  # the last token needs no forward pass: it is chosen after the loop
        return (state["t"] < max_new_tokens - 1) & ~jnp.all(state["done"])

    def choose(state):
        """Draw token t of every row from the current logits and record it."""
        t, done = state["t"], state["done"]
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, t)
        token, behavior, raw = choose_tokens(state["logits"], keys, sampling)
        token = jnp.where(done, sampling.pad_id, token)
        behavior = jnp.where(done, 0.0, behavior)
        raw = jnp.where(done, 0.0, raw)
        hit_eos = jnp.isin(token, eos) & ~done if eos.size else jnp.zeros_like(done)
        return token, dict(
            state,
            t=t + 1,
            done=done | hit_eos,
            lengths=state["lengths"] + (~done).astype(jnp.int32),
            tokens=state["tokens"].at[:, t].set(token),
            behavior=state["behavior"].at[:, t].set(behavior),
            raw=state["raw"].at[:, t].set(raw),
        )

    def step(state):
        done = state["done"]
        token, state = choose(state)
        # rows that already ended feed a harmless id; their outputs are discarded
        fed = jnp.where(done, 0, token)
        next_logits, cache = model.apply(variables, fed[:, None], cache=state["cache"])
        return dict(state, cache=cache, logits=next_logits[:, 0])

    state = dict(
        t=jnp.int32(0),
        cache=cache,
        logits=logits,
        done=jnp.zeros((rows,), bool),
        lengths=jnp.zeros((rows,), jnp.int32),
        tokens=jnp.full((rows, max_new_tokens), sampling.pad_id, jnp.int32),
        behavior=jnp.zeros((rows, max_new_tokens), jnp.float32),
        raw=jnp.zeros((rows, max_new_tokens), jnp.float32),
    )
    state = jax.lax.while_loop(keep_going, step, state)
    _, state = choose(state)  # the last token (for rows that all ended early, a pad nobody counts)
    return Generation(
        tokens=state["tokens"],
        lengths=state["lengths"],
        terminated=state["done"],
        behavior_log_probs=state["behavior"],
        raw_log_probs=state["raw"],
    )


_generate_jit = jax.jit(
    _generate, static_argnames=("model", "sampling", "max_new_tokens", "n", "cache_len")
)


# --- the public entry point ----------------------------------------------------------------------


def _prompt_rows(prompts: Any) -> list[np.ndarray]:
    """Prompts as a list of 1-D integer arrays (a 2-D array is one prompt per row)."""
    if isinstance(prompts, (np.ndarray, jax.Array)):
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


def _bucket(length: int, limit: int) -> int:
    """The padded prompt length: the next power of two (at least 8), capped at `limit`."""
    return min(max(8, 1 << (length - 1).bit_length()), limit)


def generate(
    model: Any,
    variables: Any,
    prompts: Any,
    max_new_tokens: int,
    *,
    key: jax.Array,
    sampling: Sampling = Sampling(),
    n: int = 1,
) -> Generation:
    """Continue each prompt by up to ``max_new_tokens`` tokens, ``n`` times per prompt.

    Args:
      model: a decoder with ``init_cache``, ``max_seq_len`` and ``vocab_size`` (CausalTransformer,
        or the DecodeTransformer that `dew.inference.decode_layout` pairs with rearranged weights).
      variables: its Flax variables.
      prompts: a list of token-id lists (ragged is fine) or an integer ``[batch, length]`` array.
      max_new_tokens: how many tokens to draw at most per row.
      key: a JAX PRNG key.
      sampling: how to choose tokens.
      n: continuations per prompt; rows are ordered prompt-major (prompt i, continuation j at
        row ``i * n + j``).
    """
    from dew.nn.backbones.causal_transformer import check_tokens  # nn is the layer below

    if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if isinstance(n, bool) or int(n) != n or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a dew.sampling.Sampling, got {type(sampling).__name__}")
    max_new_tokens, n = int(max_new_tokens), int(n)
    rows = _prompt_rows(prompts)
    for i, row in enumerate(rows):
        try:
            check_tokens(row, model.vocab_size)
        except ValueError as error:
            raise ValueError(f"prompt {i}: {error}") from None
    lengths = np.array([row.size for row in rows], np.int32)
    longest = int(lengths.max())
    if longest + max_new_tokens > model.max_seq_len:
        raise ValueError(
            f"the longest prompt ({longest} tokens) plus max_new_tokens={max_new_tokens} is "
            f"{longest + max_new_tokens}, more than the model's max_seq_len={model.max_seq_len}; "
            "shorten the prompt or ask for fewer tokens"
        )

    padded_len = _bucket(longest, model.max_seq_len)
    # the padded prompt plus every drawn token but the last, which is never fed back
    cache_len = min(padded_len + max_new_tokens - 1, model.max_seq_len)
    tokens = np.zeros((len(rows), padded_len), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : row.size] = row
    return _generate_jit(
        variables, jnp.asarray(tokens), jnp.asarray(lengths), key,
        model=model, sampling=sampling, max_new_tokens=max_new_tokens, n=n, cache_len=cache_len,
    )
