"""TextToImage: a trained denoiser and its weights, ready to draw images or clips."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.checks import count
from dew.inference.text import resolve_key
from dew.sampling.guidance import CFG
from dew.sampling.sample import sample
from dew.sampling.solvers import Heun

DEFAULT = object()  # a call's guidance= left out: the task's own

_run_reader: Any = None  # reads a saved diffusion run into a TextToImage; installed by dew.inference.pipeline


def reads_runs_with(reader: Any) -> None:
    """Install the function `TextToImage.from_run` delegates to: ``reader(directory, *, step, ema, **placement)``."""
    global _run_reader
    _run_reader = reader


def as_guidance(value: Any) -> Any:
    """Guidance as a CFG (or another guidance object), from a CFG, a plain scale, or None."""
    if value is None or hasattr(value, "bind"):
        return value
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        return CFG(float(value))
    raise TypeError(f"guidance must be a CFG, a plain scale (a float) or None; got {value!r}.")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Images:
    """Drawn samples in [-1, 1], `[n, *sample_shape]`; on device until `.host()`. A latent model's
    result also carries the drawn `latents` its autoencoder decoded (None in pixel space)."""

    images: Any
    latents: Any = None

    def host(self) -> Images:
        return Images(np.asarray(self.images), None if self.latents is None else np.asarray(self.latents))

    def uint8(self) -> np.ndarray:
        """The samples as uint8 0..255 (host NumPy)."""
        from dew.pixels import to_uint8

        return to_uint8(self.images)


@dataclasses.dataclass(frozen=True, eq=False)
class TextToImage:
    """An immutable sampling task over fixed weights.

    `task(prompts_or_labels, steps=, solver=, guidance=, seed= | key=)` draws one sample per entry;
    `steps`, `solver` and `guidance` default to the task's own. `guidance` is a `CFG` or a plain
    scale (``3.0`` means ``CFG(3.0)``); None turns classifier-free guidance off.
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
    solver: Any = dataclasses.field(default_factory=Heun)
    guidance: Any = None
    steps: int = 40

    def __post_init__(self):
        object.__setattr__(self, "guidance", as_guidance(self.guidance))
        object.__setattr__(self, "steps", count(self.steps, "TextToImage.steps"))

    @classmethod
    def from_run(cls, directory: Any, *, step: int | None = None, ema: bool = True, **placement: Any) -> TextToImage:
        """The task a saved diffusion run serves: its run.json (written by `DiffusionRunConfig.save` or
        `RunConfig.save`) rebuilds the backbone, conditions, autoencoder and sampling defaults, over the
        weights of `step` (the newest by default), the EMA copy when `ema`. `placement` passes `mesh=`,
        `layout=`, `dtype=`, `param_dtype=` on as `dew.pipeline` takes them.

        Reading a run needs the checkpoint and record layers above this one, so the reader is the one
        `dew.pipeline` installs (`reads_runs_with`) when `dew.inference` is imported.
        """
        if _run_reader is None:
            raise RuntimeError("No run reader is installed; import dew.inference (dew.pipeline installs it).")
        return _run_reader(directory, step=step, ema=ema, **placement)

    def bind(self, variables: Any) -> TextToImage:
        return dataclasses.replace(self, variables=variables)

    def __call__(
        self,
        prompts_or_labels: Sequence[Any],
        *,
        steps: int | None = None,
        solver: Any = None,
        guidance: Any = DEFAULT,
        seed: int | None = None,
        key: jax.Array | None = None,
    ) -> Images:
        key = resolve_key(seed, key)
        steps = self.steps if steps is None else count(steps, "steps")
        solver = self.solver if solver is None else solver
        guidance = as_guidance(self.guidance if guidance is DEFAULT else guidance)
        entries = list(prompts_or_labels)
        if not entries:
            raise ValueError("Nothing to draw: prompts_or_labels is empty.")
        conditions = self._conditions(entries)
        if guidance is not None and not guidance.null and self._text_conditions():
            # the unconditional branch reads the empty caption's encoding, as training dropped to it
            guidance = dataclasses.replace(guidance, null=self._conditions([None] * len(entries)))
        if guidance is not None and not conditions:
            raise ValueError(
                "Guidance needs a model trained with conditions, but this task has none to guide "
                f"(its model was trained with conditions {sorted(self.conditions) or 'none'}). "
                "Pass guidance=None."
            )
        noise_key, solver_key = jax.random.split(key)
        x_T = self.process.noise(noise_key, (len(entries),) + tuple(self.sample_shape), steps=steps)
        denoise = self.process.denoiser(self.model, self.variables, conditions or None)
        x0 = sample(denoise, x_T, solver=solver, steps=steps, key=solver_key, guidance=guidance)
        x0 = self.process.final(x0, self.process.sigmas(steps))
        if self.autoencoder is None:
            return Images(jnp.clip(x0, -1.0, 1.0))
        return Images(jnp.clip(self.autoencoder.decode(x0), -1.0, 1.0), latents=x0)

    def _text_conditions(self) -> list[Any]:
        """The conditions that encode prompts themselves (TextCondition: `encode_texts`)."""
        return [condition for condition in self.conditions.values() if hasattr(condition, "encode_texts")]

    def _conditions(self, entries: list[Any]) -> dict[str, jax.Array]:
        if self._text_conditions():
            if not all(entry is None or isinstance(entry, str) for entry in entries):
                raise ValueError(
                    f"This model is conditioned on captions; got {next(e for e in entries if not isinstance(e, str))!r}. "
                    "Pass strings (or None for the empty caption)."
                )
            encoded = {}
            for condition in self._text_conditions():
                encoded.update(condition.encode_texts(entries))
            return encoded
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
