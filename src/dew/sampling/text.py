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

from dew.checks import count
from dew.data.tokens import prompt_rows
from dew.widths import padded_width


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
        object.__setattr__(self, "top_k", count(self.top_k, "top_k", optional=True))
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
    processor: Any = dataclasses.field(default=None, metadata=dict(static=True))
    real_rows: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def rows(self) -> int:
        """This process's real rows: its prompts times the continuations of each (filler rows left out)."""
        return self.tokens.shape[0] if self.real_rows is None else self.real_rows

    def host(self) -> "Generation":
        """This process's real rows as NumPy arrays on the host (filler rows dropped)."""
        rows = self.rows
        return jax.tree_util.tree_map(lambda a: local_rows(a)[:rows], self)

    @property
    def text(self) -> list[str]:
        """One string per real row, decoded by the task's processor the first time it is read."""
        cached = self.__dict__.get("_text")
        if cached is None:
            if self.processor is None:
                raise ValueError(
                    "This Generation has no processor to decode it: the task that drew it took token "
                    "ids only. Read .tokens, or build the task with a processor (RunProcessor(tokenizer))."
                )
            host = self.host()
            cached = self.processor.decode(host.tokens, host.lengths, host.terminated)
            object.__setattr__(self, "_text", cached)
        return cached


def local_rows(array: Any) -> np.ndarray:
    """The rows of `array` that this process's devices hold, in order, as a NumPy array (all of
    it for an array one process holds whole)."""
    if not isinstance(array, jax.Array) or array.is_fully_addressable:
        return np.asarray(array)
    blocks: dict[int, np.ndarray] = {}
    for shard in array.addressable_shards:
        blocks.setdefault(shard.index[0].start or 0, np.asarray(shard.data))  # replicas hold the same rows
    return np.concatenate([blocks[start] for start in sorted(blocks)])


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
    logits, cache = model.apply(variables, prompt_tokens, positions=positions, cache=cache,
                                logits_at=(prompt_lengths - 1)[:, None])  # each prompt's last token only
    logits = logits[:, 0]
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


def generate(
    model: Any,
    variables: Any,
    prompts: Any,
    max_new_tokens: int,
    *,
    key: jax.Array,
    sampling: Sampling = Sampling(),
    n: int = 1,
    row_sharding: Any = None,
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
      row_sharding: a sharding of axis 0 over a mesh to split the rows by; when the mesh spans
        several processes, `prompts` are this process's own (every process passes as many), the
        global batch is theirs in process order, and each global row's key comes from `key`.
    """
    from dew.nn.backbones.causal_transformer import check_tokens  # nn is the layer below

    max_new_tokens, n = count(max_new_tokens, "max_new_tokens"), count(n, "n")
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a dew.sampling.Sampling, got {type(sampling).__name__}")
    rows = prompt_rows(prompts)
    for i, row in enumerate(rows):
        try:
            check_tokens(row, model.vocab_size)
        except ValueError as error:
            raise ValueError(f"prompt {i}: {error}") from None
    lengths = np.array([row.size for row in rows], np.int32)
    longest = int(lengths.max())
    pooled = row_sharding is not None and jax.process_count() > 1
    if pooled:  # the processes agree on the padded width; their prompt counts must match
        from jax.experimental import multihost_utils

        shapes = np.asarray(multihost_utils.process_allgather(np.array([len(rows), longest], np.int32)))
        if len(set(shapes[:, 0].tolist())) != 1:
            raise ValueError(
                f"Every process must pass the same number of prompts; the processes passed "
                f"{shapes[:, 0].tolist()} (in process order). Pad with repeated prompts and drop their rows."
            )
        longest = int(shapes[:, 1].max())
    if longest + max_new_tokens > model.max_seq_len:
        raise ValueError(
            f"the longest prompt ({longest} tokens) plus max_new_tokens={max_new_tokens} is "
            f"{longest + max_new_tokens}, more than the model's max_seq_len={model.max_seq_len}; "
            "shorten the prompt or ask for fewer tokens"
        )

    padded_len = padded_width(longest, model.max_seq_len)
    # the padded prompt plus every drawn token but the last, which is never fed back; slot s holds
    # position s only up to the padded width, so the cache may hold more slots than max_seq_len
    # (positions, which RoPE reads, stay below it: the check above counts the real prompt)
    cache_len = padded_len + max_new_tokens - 1
    tokens = np.zeros((len(rows), padded_len), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : row.size] = row
    if row_sharding is None:
        tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    else:
        processes = jax.process_count() if pooled else 1
        tokens, lengths = (
            jax.make_array_from_process_local_data(row_sharding, a, (a.shape[0] * processes,) + a.shape[1:])
            for a in (tokens, lengths)
        )
    result = _generate_jit(
        variables, tokens, lengths, key,
        model=model, sampling=sampling, max_new_tokens=max_new_tokens, n=n, cache_len=cache_len,
    )
    return result if row_sharding is None else jax.device_put(result, row_sharding)
