"""MaskedGeneration: a masked diffusion model and its weights, ready to fill in continuations."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from dew.checks import count
from dew.diffusion.discrete import MaskedSample, as_masked_process
from dew.inference.processor import as_processor, encode_prompts
from dew.inference.text import resolve_key


@dataclasses.dataclass(frozen=True, eq=False)
class MaskedGeneration:
    """An immutable task: ``task(prompts, length, *, seed= | key=, steps=None, temperature=None)``
    continues each prompt by exactly `length` tokens with the process's reverse sampler. With a
    processor (or a tokenizer, wrapped in one) prompts may be strings and `decode` returns text."""

    model: Any
    variables: Any
    process: Any
    processor: Any = None
    steps: int = 64
    temperature: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "process", as_masked_process(self.process))
        object.__setattr__(self, "processor", as_processor(self.processor))
        object.__setattr__(self, "steps", count(self.steps, "MaskedGeneration.steps"))

    @property
    def tokenizer(self) -> Any:
        return None if self.processor is None else self.processor.tokenizer

    def __call__(self, prompts: Any, length: int, *, seed: int | None = None, key: jax.Array | None = None,
                 steps: int | None = None, temperature: float | None = None) -> MaskedSample:
        key = resolve_key(seed, key)
        return self.process.generate(
            self.model, self.variables, encode_prompts(prompts, self.processor), length, key=key,
            steps=self.steps if steps is None else steps,
            temperature=self.temperature if temperature is None else temperature,
        )

    def bind(self, variables: Any) -> MaskedGeneration:
        return dataclasses.replace(self, variables=variables)

    def decode(self, result: MaskedSample) -> list[str]:
        """Each row's filled-in text."""
        if self.processor is None:
            raise ValueError("This task has no processor; build it with processor=RunProcessor(tokenizer).")
        host = result.host()
        return [self.processor.tokenizer.decode([int(t) for t in row]) for row in host.tokens]
