"""TextToImage: a trained denoiser and its weights, ready to draw images or clips.

Besides drawing from noise, `TextToImage.prepare` starts a run from an image (img2img), repaints
the masked part of one (inpainting), or continues from latents another run stopped at (the SDXL
base -> refiner handoff); `task(prepared, seed=..., decode=...)` runs what it prepared.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.checks import count
from dew.inference.text import resolve_key
from dew.sampling.guidance import CFG
from dew.sampling.sample import sample
from dew.sampling.scheduler_solvers import AncestralEuler, FilteredDDIM
from dew.sampling.solvers import DDIM, DDPM, Euler, EulerAncestral, Heun

DEFAULT = object()  # a call's guidance= left out: the task's own

_run_reader: Any = None  # reads a saved diffusion run into a TextToImage; installed by dew.inference.pipeline


def reads_runs_with(reader: Any) -> None:
    """Install the function `TextToImage.from_run` delegates to: ``reader(directory, *, step, ema, **placement)``."""
    global _run_reader
    _run_reader = reader


_autoencoder_reader: Any = None  # reads an autoencoder directory; installed by dew.inference.pipeline


def reads_autoencoders_with(reader: Any) -> None:
    """Install the function `as_autoencoder` reads a directory with: ``reader(path) -> autoencoder``."""
    global _autoencoder_reader
    _autoencoder_reader = reader


def as_autoencoder(value: Any, where: str) -> Any:
    """An autoencoder from ``value``: a directory (str or path) is read as diffusers' AutoencoderKL layout
    (`PretrainedAutoencoder.load`, through the reader `dew.inference.pipeline` installs, since the
    interop layer sits above the objectives and tasks); anything else is returned as it is."""
    if not isinstance(value, (str, os.PathLike)):
        return value
    if _autoencoder_reader is None:
        raise RuntimeError(
            f"{where} got the directory {str(value)!r}, but no autoencoder reader is installed; import "
            "dew.inference (which installs it), or pass PretrainedAutoencoder.load(directory)."
        )
    return _autoencoder_reader(value)


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
        return Images(None if self.images is None else np.asarray(self.images),
                      None if self.latents is None else np.asarray(self.latents))

    def uint8(self) -> np.ndarray:
        """The samples as uint8 0..255 (host NumPy)."""
        from dew.pixels import to_uint8

        return to_uint8(self.images)


MASK = "inpaint_mask"  # the conditions an inpainting model reads beside its text conditions
MASKED_IMAGE = "masked_image_latents"
# solvers whose every step reads only its own two levels, so a run can stop after each to blend
ONE_STEP_SOLVERS = (DDIM, DDPM, Euler, EulerAncestral, Heun, FilteredDDIM, AncestralEuler)


def strength_start(steps: int, strength: float) -> int:
    """The index on a ``steps``-step grid where an img2img run of ``strength`` starts, as diffusers'
    img2img and inpainting pipelines pick it: ``steps - min(int(steps * strength), steps)``."""
    if isinstance(strength, bool) or not isinstance(strength, (int, float, np.integer, np.floating)) \
            or not 0.0 < float(strength) <= 1.0:
        raise ValueError(f"strength must be a number in (0, 1] (1 starts from the grid's first level, "
                         f"smaller keeps more of the image); got {strength!r}.")
    return max(steps - min(int(steps * float(strength)), steps), 0)


def pixels(image: Any, name: str = "image") -> jax.Array:
    """Images as float32 in [-1, 1], [B, H, W, C]: uint8 0..255 or floats already in [-1, 1]."""
    array = np.asarray(image) if not isinstance(image, jax.Array) else image
    if array.ndim != 4:
        raise ValueError(f"{name} must be [batch, height, width, channels]; got shape {tuple(array.shape)}. "
                         "Add a leading batch axis for one image.")
    if array.dtype == np.uint8:
        return jnp.asarray(array, jnp.float32) / 127.5 - 1.0
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise ValueError(f"{name} must be uint8 (0..255) or float in [-1, 1]; got dtype {array.dtype}.")
    array = jnp.asarray(array, jnp.float32)
    low, high = float(jnp.min(array)), float(jnp.max(array))
    if low < -1.0 - 1e-4 or high > 1.0 + 1e-4:
        raise ValueError(f"{name} floats must lie in [-1, 1] (normalized pixels); they span [{low:.3g}, {high:.3g}]. "
                         "Pass uint8 pixels, or map [0, 1] floats with x * 2 - 1.")
    return array


def _rows(array: jax.Array, rows: int, name: str) -> jax.Array:
    """``array`` with ``rows`` rows: as given, or one row repeated."""
    if array.shape[0] == rows:
        return array
    if array.shape[0] == 1:
        return jnp.repeat(array, rows, axis=0)
    raise ValueError(f"{name} has {array.shape[0]} rows; pass one row, or one per prompt ({rows}).")


@dataclasses.dataclass(frozen=True)
class InpaintingInputs:
    """An inpainting model (SD/SDXL 9-channel UNets): its input is the noisy latents, the latent-size
    mask and the masked image's latents, concatenated on channels; the last two ride in the
    conditions (`MASK`, `MASKED_IMAGE`), so both guidance branches see them."""

    model: Any

    def apply(self, variables, x, noise_input, conditions):
        conditions = dict(conditions)
        mask, masked = conditions.pop(MASK), conditions.pop(MASKED_IMAGE)
        x = jnp.concatenate([x, mask.astype(x.dtype), masked.astype(x.dtype)], axis=-1)
        return self.model.apply(variables, x, noise_input, conditions)


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedImages:
    """What `TextToImage.prepare` made of its inputs; `task(prepared, seed=...)` runs it.

    Attributes:
      conditions, null: the encoded conditions of the prompts and of the unconditional branch.
      steps: the step count of the source grid; start, stop: the part of it this run takes.
      sigmas: that part's levels (``stop - start + 1``), from the task's process.
      rows, sample_shape: the number of prompts and the shape of one latent.
      image_latents: the clean latents an img2img or inpainting run starts from (None otherwise).
      noise: the unit Gaussian noise added to them, or the starting noise of a text-to-image run
        (None: drawn from the call's seed).
      initial: an already noisy state in sigma space (never noised again), or None.
      repaint: for a 4-channel model's inpainting, the latent-size mask (1 = repaint) that holds the
        rest of the image to ``image_latents`` noised to each level; None otherwise.
      pure_noise: inpainting from the grid's first level starts from noise alone, as the pipelines do.
    """

    conditions: Mapping[str, Any]
    null: Any
    steps: int
    start: int
    stop: int
    sigmas: Any
    rows: int
    sample_shape: tuple[int, ...]
    image_latents: Any = None
    noise: Any = None
    initial: Any = None
    repaint: Any = None
    pure_noise: bool = False


@functools.partial(jax.jit, static_argnames=("solver",))
def _blended(solver, denoise, guidance, x, sigmas, key, image_latents, noise, repaint):
    """One solver step at a time; after each, the part outside ``repaint`` is set back to the image's
    latents noised to the level the step landed on (diffusers' 4-channel inpainting)."""
    guided = denoise if guidance is None else guidance.bind(denoise, sigmas)

    def body(x, i):
        pair = jax.lax.dynamic_slice(sigmas, (i,), (2,))
        step_key = None if key is None else jax.random.fold_in(key, i)
        x, _ = solver.integrate(guided, x, pair, step_key)
        return repaint * x + (1.0 - repaint) * (image_latents + pair[1] * noise), None

    x, _ = jax.lax.scan(body, x, jnp.arange(sigmas.shape[0] - 1))
    return x


@dataclasses.dataclass(frozen=True, eq=False)
class TextToImage:
    """An immutable sampling task over fixed weights.

    `task(prompts_or_labels, steps=, solver=, guidance=, seed= | key=)` draws one sample per entry;
    `steps`, `solver` and `guidance` default to the task's own. `autoencoder` (latent models) may
    be given as a diffusers AutoencoderKL directory, read with `PretrainedAutoencoder.load`. `guidance` is a `CFG` or a plain
    scale (``3.0`` means ``CFG(3.0)``); None turns classifier-free guidance off.
    Integer entries are class labels for a model conditioned on "label" (None draws
    unconditionally); with no text encoder, strings only set how many samples to draw, and a model
    trained without conditions draws unconditionally. ``decode=False`` returns the unclipped
    latents with ``images=None``. `prepare` builds inputs that start from an image, inpaint, or
    continue another run (see the module docstring); the task runs those the same way.
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
        object.__setattr__(self, "autoencoder", as_autoencoder(self.autoencoder, "TextToImage(autoencoder=)"))

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
        decode: bool = True,
    ) -> Images:
        key = resolve_key(seed, key)
        solver = self.solver if solver is None else solver
        guidance = as_guidance(self.guidance if guidance is DEFAULT else guidance)
        if isinstance(prompts_or_labels, PreparedImages):
            if steps is not None and count(steps, "steps") != prompts_or_labels.steps:
                raise ValueError(f"This input was prepared on the {prompts_or_labels.steps}-step grid; to change "
                                 "the step count, prepare it again with steps=.")
            return self._run(prompts_or_labels, solver=solver, guidance=guidance, key=key, decode=decode)
        steps = self.steps if steps is None else count(steps, "steps")
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
        return self._output(self.process.final(x0, self.process.sigmas(steps)), decode)

    def prepare(
        self,
        prompts: Sequence[Any],
        *,
        image: Any = None,
        image_latents: Any = None,
        mask: Any = None,
        times: Any = None,
        strength: float | None = None,
        noise: Any = None,
        initial: Any = None,
        encode_key: jax.Array | None = None,
        unconditional: Any = None,
        steps: int | None = None,
    ) -> PreparedImages:
        """Encode the prompts and the starting point of a run on part of the source grid.

        ``image`` (uint8, or floats in [-1, 1], [B, H, W, C]) is encoded by the autoencoder (its
        posterior mean, or a draw under ``encode_key``); ``image_latents`` are latents already
        encoded. The run starts at ``times`` (a step index on the ``steps``-step grid, or a
        ``(start, stop)`` pair that also ends it early) or where ``strength`` puts it (diffusers'
        rule, `strength_start`), from ``image_latents + sigma * noise`` in sigma space (alpha(t)
        latents + sigma(t) noise in the scheduler's). ``mask`` [B, H, W, 1] (1 = repaint) inpaints:
        a 9-channel model reads the mask and the masked image's latents beside its input, a
        4-channel model has the unmasked part held to the image after every step. ``initial`` is
        an already noisy state in the scheduler's space, at the first level of the run's grid.
        ``unconditional`` replaces the empty prompt of the guidance branch: strings or encoded
        condition rows, one or one per prompt.
        """
        steps = self.steps if steps is None else count(steps, "steps")
        entries = list(prompts)
        if not entries:
            raise ValueError("Nothing to draw: prompts is empty.")
        rows = len(entries)
        if image is not None and image_latents is not None:
            raise ValueError("Pass image= (pixels, encoded here) or image_latents= (already encoded), not both.")
        if initial is not None and (image is not None or image_latents is not None or noise is not None
                                    or strength is not None or mask is not None):
            raise ValueError("initial= is a state that is already noisy, so it takes no image, image_latents, "
                             "noise, strength or mask; give the run's part of the grid with times= instead.")
        if strength is not None and times is not None:
            raise ValueError("Pass strength= (diffusers' img2img rule) or times= (an explicit start), not both.")
        start, stop = self._span(steps, times, strength)
        sigmas = self.process.sigmas(steps)[start:stop + 1]

        latents = None
        clean = None
        if image is not None:
            clean = _rows(pixels(image), rows, "image")
            latents = self._encode(clean, encode_key)
        elif image_latents is not None:
            latents = _rows(jnp.asarray(image_latents, jnp.float32), rows, "image_latents")
        shape = tuple(latents.shape[1:]) if latents is not None else tuple(self.sample_shape)
        if latents is None and start > 0 and initial is None:
            raise ValueError(f"A run starting at step {start} of {steps} needs a state there: pass image=, "
                             "image_latents= or initial= (or start at step 0).")

        conditions = self._conditions(entries)
        null = self._conditions([None] * rows) if self._text_conditions() else None
        if unconditional is not None:
            null = self._unconditional(unconditional, rows, conditions)

        repaint = None
        if mask is not None:
            if latents is None:
                raise ValueError("mask= inpaints an image: pass image= (or image_latents= for a 4-channel model).")
            extra, repaint = self._inpainting(mask, clean, latents, rows, encode_key)
            conditions = {**conditions, **extra}
            null = None if null is None else {**null, **extra}

        if noise is not None:
            noise = jnp.asarray(noise, jnp.float32)
            if noise.shape != (rows,) + shape:
                raise ValueError(f"noise must have the latents' shape {(rows,) + shape} (one unit Gaussian row "
                                 f"per prompt); got {tuple(noise.shape)}.")
        if initial is not None:
            initial = _rows(jnp.asarray(initial, jnp.float32), rows, "initial")
            if initial.shape[1:] != shape:
                raise ValueError(f"initial must have the latents' shape {(rows,) + shape}; got {tuple(initial.shape)}.")
            initial = initial / self.process.final(jnp.ones((), jnp.float32), sigmas[:1])
        return PreparedImages(
            conditions=conditions, null=null, steps=steps, start=start, stop=stop, sigmas=sigmas, rows=rows,
            sample_shape=shape, image_latents=latents, noise=noise, initial=initial, repaint=repaint,
            pure_noise=mask is not None and start == 0)

    def _span(self, steps: int, times: Any, strength: float | None) -> tuple[int, int]:
        """(start, stop): the step indices of the source grid a prepared run takes."""
        if strength is not None:
            return strength_start(steps, strength), steps
        if times is None:
            return 0, steps
        span = (times, steps) if isinstance(times, (int, np.integer)) else tuple(times)
        if len(span) != 2 or not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in span) \
                or not 0 <= span[0] < span[1] <= steps:
            raise ValueError(f"times must be a step index 0 <= start < {steps} on the {steps}-step source grid, or "
                             f"a (start, stop) pair with start < stop <= {steps}; got {times!r}.")
        return int(span[0]), int(span[1])

    def _encode(self, images: jax.Array, key: jax.Array | None) -> jax.Array:
        if self.autoencoder is None:
            return images
        self.autoencoder.latent_shape(tuple(images.shape[1:]))  # raises for sides off the VAE's factor
        return jnp.asarray(self.autoencoder.encode(images, key), jnp.float32)

    def _inpainting(self, mask: Any, clean: Any, latents: jax.Array, rows: int, key: Any) -> tuple[dict, Any]:
        """The masked-image conditions of a 9-channel model, or the repaint mask of a 4-channel one."""
        mask = jnp.asarray(mask, jnp.float32)
        height, width = (clean.shape[1:3] if clean is not None
                         else (latents.shape[1] * self._factor(), latents.shape[2] * self._factor()))
        if mask.ndim != 4 or mask.shape[1:] != (height, width, 1) or mask.shape[0] not in (1, rows):
            raise ValueError(f"mask must be a pixel mask [batch, {height}, {width}, 1] (1 = repaint) with one row "
                             f"or one per prompt ({rows}); got shape {tuple(mask.shape)}.")
        mask = (_rows(mask, rows, "mask") >= 0.5).astype(jnp.float32)  # binarized, as the pipelines do
        factor = height // latents.shape[1]
        small = mask[:, ::factor, ::factor, :]  # nearest-neighbour downsampling to the latents
        channels = latents.shape[-1]
        in_channels = getattr(self.model, "in_channels", channels)
        if in_channels == 2 * channels + 1:
            if clean is None:
                raise ValueError("A 9-channel inpainting model reads the masked image's latents: pass image= "
                                 "(pixels), not image_latents=.")
            masked = self._encode(clean * (mask < 0.5), key)
            return {MASK: small, MASKED_IMAGE: masked}, None
        if in_channels != channels:
            raise ValueError(f"This model takes {in_channels} input channels; inpainting needs {channels} (the "
                             f"latents, blended) or {2 * channels + 1} (latents, mask, masked-image latents).")
        return {}, jnp.broadcast_to(small, latents.shape)

    def _factor(self) -> int:
        return getattr(getattr(self.autoencoder, "model", None), "downsampling", 1)

    def _unconditional(self, unconditional: Any, rows: int, conditions: Mapping[str, Any]) -> dict[str, Any]:
        if isinstance(unconditional, Mapping):
            if set(unconditional) != set(conditions):
                raise ValueError(f"unconditional= rows must hold the conditions {sorted(conditions)}; "
                                 f"got {sorted(unconditional)}.")
            return {name: _rows(jnp.asarray(value), rows, f"unconditional[{name!r}]")
                    for name, value in unconditional.items()}
        if isinstance(unconditional, str) or not isinstance(unconditional, Sequence):
            raise ValueError("unconditional= takes a list of prompts (one, or one per prompt) or a mapping of "
                             f"encoded condition rows; got {type(unconditional).__name__}.")
        encoded = self._conditions(list(unconditional))
        for condition in self._text_conditions():
            if hasattr(condition, "time_ids"):  # SDXL: the unconditional rows' own ids (negative aesthetic score)
                encoded["time_ids"] = condition.time_ids(jnp.ones((len(unconditional),), bool))
        return {name: _rows(value, rows, "unconditional") for name, value in encoded.items()}

    def _run(self, prepared: PreparedImages, *, solver: Any, guidance: Any, key: jax.Array,
             decode: bool) -> Images:
        """Run a prepared input from its grid's first level to its last."""
        expected = self.process.sigmas(prepared.steps)[prepared.start:prepared.stop + 1]
        if not np.array_equal(np.asarray(expected), np.asarray(prepared.sigmas)):
            raise ValueError("This prepared input was made for another process's grid; prepare it with this task.")
        sigmas = prepared.sigmas
        conditions = dict(prepared.conditions)
        if guidance is not None and not guidance.null and prepared.null is not None:
            guidance = dataclasses.replace(guidance, null=prepared.null)
        elif guidance is not None and MASK in conditions:
            guidance = dataclasses.replace(guidance, null={**guidance.null, MASK: conditions[MASK],
                                                           MASKED_IMAGE: conditions[MASKED_IMAGE]})
        if guidance is not None and not conditions:
            raise ValueError("Guidance needs a model trained with conditions; this task has none. Pass guidance=None.")
        noise_key, solver_key = jax.random.split(key)
        shape = (prepared.rows,) + prepared.sample_shape
        noise = prepared.noise if prepared.noise is not None else jax.random.normal(noise_key, shape, jnp.float32)
        if prepared.initial is not None:
            x = prepared.initial
        elif prepared.image_latents is None or prepared.pure_noise:
            scheduler = getattr(self.process, "scheduler", None)
            full = self.process.sigmas(prepared.steps)
            x = scheduler.initial(noise, full) if hasattr(scheduler, "initial") else full[0] * noise
        else:
            x = prepared.image_latents + sigmas[0] * noise
        model = InpaintingInputs(self.model) if MASK in conditions else self.model
        denoise = self.process.denoiser(model, self.variables, conditions or None)
        if prepared.repaint is None:
            x0 = sample(denoise, x, solver=solver, steps=len(sigmas) - 1, key=solver_key, guidance=guidance,
                        grid=sigmas)
            latents = self.process.final(x0, sigmas)
        else:
            if not isinstance(solver, ONE_STEP_SOLVERS):
                raise ValueError(f"Inpainting with a 4-channel model holds the image after every step, which "
                                 f"needs a solver whose steps stand alone; {type(solver).__name__} carries state "
                                 "between steps. Use a DDIM or Euler scheduler (or a 9-channel inpainting model).")
            key_ = solver_key if solver.stochastic else None
            x0 = _blended(solver, denoise, guidance, x, sigmas, key_, prepared.image_latents, noise, prepared.repaint)
            latents = self.process.final(x0, sigmas)
            if prepared.stop == prepared.steps:  # the last step lands on the image itself
                latents = prepared.repaint * latents + (1.0 - prepared.repaint) * prepared.image_latents
            if not bool(jnp.all(jnp.isfinite(latents))):
                raise FloatingPointError("inpainting produced NaN or Inf; check the denoiser and the inputs")
        return self._output(latents, decode)

    def _output(self, latents: jax.Array, decode: bool) -> Images:
        if self.autoencoder is None:
            return Images(jnp.clip(latents, -1.0, 1.0) if decode else None, latents=None if decode else latents)
        if not decode:
            return Images(None, latents=latents)
        return Images(jnp.clip(self.autoencoder.decode(latents), -1.0, 1.0), latents=latents)

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
