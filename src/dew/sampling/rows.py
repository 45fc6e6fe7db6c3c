"""Choosing tokens when every row has its own `Sampling`.

`choose_tokens` takes one Sampling, a static argument, so a batch of rows that mix greedy and
sampled settings would compile a program per mix. Here the settings are arrays with a value per
row (`RowSampling`), so one compiled program serves any mix. Each filter computes, row by row,
what `process_logits` computes for that row's Sampling alone, in the same order (temperature,
top-k, top-p, min-p) with the same operations: a row draws the token it would draw alone.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dew.sampling.text import Sampling


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Sampling settings as ``[rows]`` arrays; a setting that is off takes a value that filters nothing.

    Attributes:
      temperature: float32; 0 is greedy.
      top_k: int32; 0 keeps every token.
      top_p: float32; 1 keeps every token.
      min_p: float32; 0 keeps every token.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array

    @classmethod
    def empty(cls, rows: int) -> "RowSampling":
        """Greedy settings for `rows` rows (a placeholder until rows get their own)."""
        return cls(
            temperature=jnp.zeros((rows,), jnp.float32), top_k=jnp.zeros((rows,), jnp.int32),
            top_p=jnp.ones((rows,), jnp.float32), min_p=jnp.zeros((rows,), jnp.float32),
        )

    @staticmethod
    def of(sampling: Sampling) -> "RowSampling":
        """One row's settings (NumPy scalars) for `sampling`."""
        return RowSampling(
            temperature=np.float32(sampling.temperature),
            top_k=np.int32(sampling.top_k or 0),
            top_p=np.float32(1.0 if sampling.top_p is None else sampling.top_p),
            min_p=np.float32(sampling.min_p or 0.0),
        )

    def set_row(self, row: jax.Array, one: "RowSampling") -> "RowSampling":
        """These settings with row `row` replaced by `one`'s scalars."""
        return jax.tree_util.tree_map(lambda rows, value: rows.at[row].set(value), self, one)


def process_rows(logits: jax.Array, settings: RowSampling) -> jax.Array:
    """Each row's logits ``[rows, vocab]`` as `process_logits` leaves them for that row's Sampling.

    Greedy rows (temperature 0) come back divided by 1; they do not sample.
    """
    vocab = logits.shape[-1]
    temperature = jnp.where(settings.temperature > 0, settings.temperature, 1.0)
    x = logits.astype(jnp.float32) / temperature[:, None]
    ranked = jnp.sort(x, axis=-1)[..., ::-1]
    # top-k: the k-th largest value is the floor (ties with it are kept)
    k = jnp.where(settings.top_k > 0, jnp.minimum(settings.top_k, vocab), vocab)
    kth = jnp.take_along_axis(ranked, (k - 1)[:, None], axis=-1)
    x = jnp.where(x < kth, -jnp.inf, x)
    ranked = jnp.where(ranked < kth, -jnp.inf, ranked)  # the sorted survivors, as sorting x again gives
    # top-p: the smallest set of best tokens whose probability reaches top_p
    probs = jax.nn.softmax(ranked, axis=-1)
    mass_above = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_above < settings.top_p[:, None]
    threshold = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where((settings.top_p[:, None] < 1) & (x < threshold), -jnp.inf, x)
    # min-p: tokens at least min_p times as likely as the best one
    probs = jax.nn.softmax(x, axis=-1)
    floor = settings.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where((settings.min_p[:, None] > 0) & (probs < floor), -jnp.inf, x)


def choose_row_tokens(logits: jax.Array, keys: jax.Array, settings: RowSampling) -> tuple[jax.Array, jax.Array]:
    """Next tokens ``[rows]`` and their log-probabilities under each row's processed distribution.

    A greedy row takes the most likely token with log-probability 0 (a point mass), as
    `choose_tokens` does; a sampled row draws with its own key.
    """
    processed = process_rows(logits, settings)
    drawn = jax.vmap(jax.random.categorical)(keys, processed).astype(jnp.int32)
    greedy = settings.temperature <= 0
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), drawn)
    log_probs = jnp.take_along_axis(jax.nn.log_softmax(processed, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, jnp.where(greedy, 0.0, log_probs)
