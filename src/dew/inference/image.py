"""TextToImage: a trained denoiser and its weights, ready to draw images or clips."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Images:
    """Drawn samples in [-1, 1], `[n, *sample_shape]`; on device until `.host()`."""

    images: Any

    def host(self) -> Images:
        return Images(np.asarray(self.images))

    def uint8(self) -> np.ndarray:
        """The samples as uint8 0..255 (host NumPy)."""
        from dew.pixels import to_uint8

        return to_uint8(self.images)


@dataclasses.dataclass(frozen=True, eq=False)
class TextToImage:
    """An immutable sampling task over fixed weights.

    `task(prompts_or_labels, steps=, solver=, guidance=, seed= | key=)` draws one sample per entry.
    Integer entries are class labels for a model conditioned on "label" (None draws
    unconditionally); with no text encoder, strings only set how many samples to draw, and a model
    trained without conditions draws unconditionally.
    """

    model: Any
    variables: Any
    process: Any
    sample_shape: tuple[int, ...]
    conditions: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    autoencoder: Any = None

    def bind(self, variables: Any) -> TextToImage:
        return dataclasses.replace(self, variables=variables)

    def __call__(
        self,
        prompts_or_labels: Sequence[Any],
        *,
        steps: int = 40,
        solver: Any = None,
        guidance: Any = None,
        seed: int | None = None,
        key: jax.Array | None = None,
    ) -> Images:
        from dew.sampling.sample import sample
        from dew.sampling.solvers import Heun

        if (key is None) == (seed is None):
            raise ValueError("Pass exactly one of key= (a jax.random key) or seed= (an int).")
        key = jax.random.key(int(seed)) if key is None else key
        entries = list(prompts_or_labels)
        if not entries:
            raise ValueError("Nothing to draw: prompts_or_labels is empty.")
        conditions = self._conditions(entries)
        if guidance is not None and not conditions:
            raise ValueError(
                "Guidance needs a model trained with conditions, but this task has none to guide "
                f"(its model was trained with conditions {sorted(self.conditions) or 'none'}). "
                "Pass guidance=None."
            )
        noise_key, solver_key = jax.random.split(key)
        x_T = self.process.noise(noise_key, (len(entries),) + tuple(self.sample_shape))
        denoise = self.process.denoiser(self.model, self.variables, conditions or None)
        x0 = sample(denoise, x_T, solver=solver or Heun(), steps=steps, key=solver_key, guidance=guidance)
        if self.autoencoder is not None:
            x0 = self.autoencoder.decode(x0)
        return Images(jnp.clip(x0, -1.0, 1.0))

    def _conditions(self, entries: list[Any]) -> dict[str, jax.Array]:
        if "label" in self.conditions:
            labels = []
            for entry in entries:
                if entry is None:
                    labels.append(-1)
                elif isinstance(entry, (int, np.integer)) and not isinstance(entry, bool):
                    labels.append(int(entry))
                else:
                    raise ValueError(
                        f"This model is conditioned on class labels; got {entry!r}. Pass ints (or None "
                        "for an unconditional sample)."
                    )
            return {"label": jnp.asarray(labels, jnp.int32)}
        if self.conditions:
            names = sorted(self.conditions)
            raise ValueError(
                f"This model is conditioned on {names}, which needs an encoder for the prompts; "
                "none is attached to this task."
            )
        return {}
