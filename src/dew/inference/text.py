"""TextGeneration: a decoder and its weights, ready to continue prompts."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax
import numpy as np

from dew.checks import count
from dew.data.tokens import prompt_rows
from dew.inference.decode_layout import DecodeWeights
from dew.inference.processor import RunProcessor, as_processor, encode_prompts
from dew.sampling.text import Generation, Sampling, generate
from dew.widths import padded_width


def resolve_key(seed: Any, key: Any) -> jax.Array:
    """The key a task call draws with: exactly one of `seed` (an int) or `key` (a JAX key, or an
    int that seeds one, so `key=0` draws as `seed=0` does)."""
    if (key is None) == (seed is None):
        given = "both" if key is not None else "neither"
        raise ValueError(f"Pass exactly one of seed= (an int) or key= (a jax.random key); got {given}.")
    if key is not None:
        if isinstance(key, numbers.Integral) and not isinstance(key, bool):
            return jax.random.key(int(key))
        return key
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int; got {seed!r} ({type(seed).__name__}).")
    return jax.random.key(int(seed))


@dataclasses.dataclass(frozen=True, eq=False)
class TextGeneration:
    """An immutable generation task over fixed weights.

    ``task(prompts, max_new_tokens=None, *, seed= | key=, sampling=None, n=None)`` runs
    `generate`. Prompts are token-id rows, or strings when the task has a `processor`.

    Attributes:
      model, variables: the decoder and its Flax variables.
      sampling: the default Sampling (a call's `sampling=` wins).
      processor: a RunProcessor (or a bare tokenizer, wrapped in one) so prompts may be text and
        results have `.text`; None for a token-only task.
      max_new_tokens: the default continuation budget (a call's budget wins).
      max_length: a default total length: the budget is then max_length minus the padded prompt
        width (used when max_new_tokens is None, as in generation_config.json).
      n: the default number of continuations per prompt.
      row_sharding: for weights placed on a mesh, the sharding of result rows; the prompts are
        padded with filler rows to a multiple of its row shards, and `result.host()` drops them.
        On a mesh over several processes each process passes its own prompts and `host()` holds
        its own rows.

    On XLA:CPU, one row and batches of 3 to 48 rows decode from the weights' decode layout
    (`dew.inference.decode_layout`), converted on first use and kept with the task; `bind` makes a
    task with its own.
    """

    model: Any
    variables: Any
    sampling: Sampling = Sampling()
    processor: Any = None
    max_new_tokens: int | None = None
    max_length: int | None = None
    n: int = 1
    row_sharding: Any = None
    weights: DecodeWeights = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        # decoding on XLA:CPU reads a decode layout of these weights, made once per task
        object.__setattr__(self, "weights", DecodeWeights(self.model, self.variables))
        object.__setattr__(self, "processor", as_processor(self.processor))
        object.__setattr__(self, "n", count(self.n, "TextGeneration.n"))
        object.__setattr__(self, "max_new_tokens", count(self.max_new_tokens, "TextGeneration.max_new_tokens", optional=True))
        object.__setattr__(self, "max_length", count(self.max_length, "TextGeneration.max_length", optional=True))
        if not isinstance(self.sampling, Sampling):
            raise TypeError(f"sampling must be a dew.sampling.Sampling; got {type(self.sampling).__name__}.")

    @property
    def tokenizer(self) -> Any:
        """The processor's tokenizer, or None."""
        return None if self.processor is None else self.processor.tokenizer

    def __call__(
        self,
        prompts: Any,
        max_new_tokens: int | None = None,
        *,
        seed: int | None = None,
        key: jax.Array | None = None,
        sampling: Sampling | None = None,
        n: int | None = None,
    ) -> Generation:
        key = resolve_key(seed, key)
        n = self.n if n is None else count(n, "n")
        rows = prompt_rows(encode_prompts(prompts, self.processor))
        budget = self.budget(rows, max_new_tokens)
        real = len(rows)
        if self.row_sharding is not None:  # filler prompts so each process's rows split over its devices
            shards = max(_row_shards(self.row_sharding) // jax.process_count(), 1)
            rows = rows + [rows[0]] * (-real % shards)  # dropped by .host()
        model, variables = self.weights.get(len(rows) * n)
        result = generate(model, variables, rows, budget, key=key, row_sharding=self.row_sharding,
                          sampling=self.sampling if sampling is None else sampling, n=n)
        return dataclasses.replace(result, processor=self.processor, real_rows=real * n)

    def budget(self, rows: list[np.ndarray], max_new_tokens: int | None = None) -> int:
        """The continuation budget for these prompt rows: the call's, the task's, or max_length's."""
        if max_new_tokens is not None:
            return count(max_new_tokens, "max_new_tokens")
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        if self.max_length is not None:
            width = padded_width(max(row.size for row in rows), self.model.max_seq_len)
            if self.max_length <= width:
                raise ValueError(
                    f"The task's max_length={self.max_length} leaves no room after the padded prompt "
                    f"width of {width} tokens; pass max_new_tokens to the call."
                )
            return self.max_length - width
        raise ValueError(
            "No continuation budget: pass max_new_tokens (task(prompts, 32, seed=0)); this task's "
            "source sets neither max_new_tokens nor max_length."
        )

    def bind(self, variables: Any) -> TextGeneration:
        """The same task over other weights (the arrays are shared, not copied)."""
        return dataclasses.replace(self, variables=variables)

    def decode(self, generation: Generation) -> list[str]:
        """Each real row's generated text (the same as ``generation.text`` for this task's results)."""
        if self.processor is None:
            raise ValueError("This task has no processor; build it with processor=RunProcessor(tokenizer).")
        return dataclasses.replace(generation, processor=self.processor).text


def _row_shards(sharding: Any) -> int:
    """How many ways `sharding` splits axis 0."""
    spec = sharding.spec
    axes = spec[0] if len(spec) else None
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([sharding.mesh.shape[a] for a in axes]))


__all__ = ["RunProcessor", "TextGeneration", "resolve_key"]
