"""TextGeneration: a decoder and its weights, ready to continue prompts."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from dew.sampling.text import Generation, Sampling, generate


@dataclasses.dataclass(frozen=True, eq=False)
class TextGeneration:
    """An immutable generation task over fixed weights.

    ``task(prompts, max_new_tokens, key=... | seed=..., sampling=None, n=1)`` runs `generate`
    with the task's sampling unless another is passed. With a tokenizer (anything with
    ``encode(text) -> ids`` and ``decode(ids) -> text``) prompts may be strings and `decode` turns
    a Generation back into text.
    """

    model: Any
    variables: Any
    sampling: Sampling = Sampling()
    tokenizer: Any = None

    def __call__(
        self,
        prompts: Any,
        max_new_tokens: int,
        *,
        key: jax.Array | None = None,
        seed: int | None = None,
        sampling: Sampling | None = None,
        n: int = 1,
    ) -> Generation:
        if (key is None) == (seed is None):
            raise ValueError("pass exactly one of key= (a jax.random key) or seed= (an int)")
        if key is None:
            key = jax.random.key(int(seed))
        return generate(
            self.model, self.variables, encode_prompts(prompts, self.tokenizer), max_new_tokens,
            key=key, sampling=self.sampling if sampling is None else sampling, n=n,
        )

    def bind(self, variables: Any) -> "TextGeneration":
        """The same task over other weights."""
        return dataclasses.replace(self, variables=variables)

    def decode(self, generation: Generation) -> list[str]:
        """Each row's generated text: its tokens up to its length, a final EOS token left out."""
        if self.tokenizer is None:
            raise ValueError("this task has no tokenizer; build it with TextGeneration(..., tokenizer=...)")
        result = generation.host()
        texts = []
        for tokens, length, ended in zip(result.tokens, result.lengths, result.terminated):
            ids = tokens[: int(length) - (1 if ended else 0)]
            texts.append(self.tokenizer.decode([int(i) for i in ids]))
        return texts


def encode_prompts(prompts: Any, tokenizer: Any) -> Any:
    """Text prompts (a string or a list of strings) as token-id rows; token ids pass through."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass token ids or build the task with tokenizer=")
        return [np.asarray(tokenizer.encode(p), np.int32) for p in prompts]
    return prompts
