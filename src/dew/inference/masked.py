"""MaskedGeneration: a masked diffusion model and its weights, ready to fill in continuations."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from dew.diffusion.discrete import MaskedSample, as_masked_process
from dew.inference.text import encode_prompts


@dataclasses.dataclass(frozen=True, eq=False)
class MaskedGeneration:
    """An immutable task: ``task(prompts, length, key=... | seed=..., steps=None)`` continues each
    prompt by exactly `length` tokens with the process's reverse sampler. With a tokenizer, prompts
    may be strings and `decode` turns the result into text."""

    model: Any
    variables: Any
    process: Any
    tokenizer: Any = None
    steps: int = 64
    temperature: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "process", as_masked_process(self.process))

    def __call__(self, prompts: Any, length: int, *, key: jax.Array | None = None, seed: int | None = None,
                 steps: int | None = None, temperature: float | None = None) -> MaskedSample:
        if (key is None) == (seed is None):
            raise ValueError("pass exactly one of key= (a jax.random key) or seed= (an int)")
        if key is None:
            key = jax.random.key(int(seed))
        return self.process.generate(
            self.model, self.variables, encode_prompts(prompts, self.tokenizer), length, key=key,
            steps=self.steps if steps is None else steps,
            temperature=self.temperature if temperature is None else temperature,
        )

    def bind(self, variables: Any) -> "MaskedGeneration":
        return dataclasses.replace(self, variables=variables)

    def decode(self, result: MaskedSample) -> list[str]:
        if self.tokenizer is None:
            raise ValueError("this task has no tokenizer; build it with MaskedGeneration(..., tokenizer=...)")
        return [self.tokenizer.decode([int(t) for t in row]) for row in result.host().tokens]

