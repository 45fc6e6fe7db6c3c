"""Diffusion and flow-matching training on images and clips.

The objective maps uint8 samples to [-1, 1] (or encodes them to latents with an autoencoder),
draws a noise level from the process, noises the sample, and regresses the backbone's output on the
process's target with the process's weighting. Conditions (labels, embeddings) are dropped per row
with `unconditional_prob`, so the same model also learns the unconditional denoiser that
classifier-free guidance needs: a dropped label becomes -1 (the backbone's null class) and a dropped
embedding becomes zeros.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dew.diffusion.presets import as_process
from dew.inference.image import TextToImage
from dew.objectives.base import Aux, InputSpec, Objective, inference_variables
from dew.pixels import to_unit_range
from dew.tracking.records import Artifact


class Autoencoder(Protocol):
    """What latent diffusion needs from a (frozen) autoencoder: its weights live inside it.

    `encode` returns the posterior mean without a key and a posterior draw with one
    (`dew.interop.autoencoders.PretrainedAutoencoder` is one).
    """

    def encode(self, images: jax.Array, key: jax.Array | None = None) -> jax.Array: ...

    def decode(self, latents: jax.Array) -> jax.Array: ...

    def latent_shape(self, sample_shape: tuple[int, ...]) -> tuple[int, ...]: ...


class DiffusionObjective(Objective):
    """Denoising loss for `model` under `process` (a Process or a preset such as `EDM()`).

    `inputs` names the sample field first (uint8 images `(H, W, C)` or clips `(T, H, W, C)`), and
    its `conditions` name the conditioning fields (`"label"` int ids, or float embeddings). With
    `evaluation_steps`, each validation batch also draws samples (Heun, that many steps, with the
    batch's conditions) and returns them as "samples" beside the real "images", both in [-1, 1],
    for sample metrics such as FID.
    """

    def __init__(
        self,
        model: Any,
        process: Any,
        inputs: InputSpec,
        *,
        ema_decay: float | None = 0.999,
        unconditional_prob: float = 0.1,
        autoencoder: Autoencoder | None = None,
        preview_count: int = 16,
        preview_steps: int = 32,
        evaluation_steps: int | None = None,
    ):
        if not isinstance(inputs, InputSpec) or not inputs.fields:
            raise ValueError("DiffusionObjective needs InputSpec(Field(sample, shape), conditions=...).")
        if not 0.0 <= unconditional_prob <= 1.0:
            raise ValueError(f"unconditional_prob must be in [0, 1]; got {unconditional_prob}.")
        self.model = model
        self.process = as_process(process)
        self.preset = process
        self.inputs = inputs
        self.sample_field = inputs.fields[0]
        self.ema_decay = ema_decay
        self.unconditional_prob = unconditional_prob
        self.autoencoder = autoencoder
        self.preview_count = preview_count
        self.preview_steps = preview_steps
        self.evaluation_steps = evaluation_steps

    @property
    def conditional(self) -> bool:
        return bool(self.inputs.conditions)

    @property
    def model_shape(self) -> tuple[int, ...]:
        """The shape the backbone sees for one example (latent shape with an autoencoder)."""
        shape = tuple(self.sample_field.shape)
        return self.autoencoder.latent_shape(shape) if self.autoencoder is not None else shape

    def _condition_examples(self, rows: int) -> dict[str, jax.Array]:
        examples = {}
        for name, field in self.inputs.conditions.items():
            if hasattr(field, "encode"):  # a TextCondition: the encoder's outputs, not the ids
                examples.update({key: jnp.zeros(spec.shape, spec.dtype) for key, spec in field.examples(rows).items()})
                continue
            dtype = field.dtype or (jnp.int32 if name == "label" else jnp.float32)
            examples[name] = jnp.zeros((rows,) + tuple(field.shape), dtype)
        return examples

    def _text_conditions(self) -> list[Any]:
        return [field for field in self.inputs.conditions.values() if hasattr(field, "frozen_variables")]

    @property
    def variables(self) -> dict[str, Any] | None:
        """The text encoders' weights, which a trainer passes to `init` as arguments rather than
        baking them into the compiled init as constants (None without text conditions)."""
        return {field.collection: field.encoder.variables for field in self._text_conditions()} or None

    @property
    def frozen_collections(self) -> tuple[str, ...]:
        """The text encoders' collections (see `TextCondition`), beside any the model names."""
        return super().frozen_collections + tuple(field.collection for field in self._text_conditions())

    def init(self, key, variables=None):
        """The model's variables (``variables`` when they hold "params"), completed with each text
        encoder's collection: from ``variables`` when given there (the trainer's held weights)."""
        held = dict(variables or {})
        if "params" in held:
            initialized = held
        else:
            x = jnp.zeros((1,) + self.model_shape, jnp.float32)
            conditions = self._condition_examples(1) or None
            initialized = dict(self.model.init(key, x, jnp.zeros((1,), jnp.float32), conditions))
        for field in self._text_conditions():
            initialized[field.collection] = field.frozen_variables(held.get(field.collection))
        return initialized

    def check(self, batch) -> None:
        super().check(batch)
        sample = np.asarray(batch[self.sample_field.key])
        if sample.dtype != np.uint8 and not np.issubdtype(sample.dtype, np.floating):
            raise ValueError(
                f"Batch field {self.sample_field.key!r} has dtype {sample.dtype}; diffusion samples are "
                "uint8 images (0..255) or floats in [-1, 1]."
            )

    def to_model_space(self, samples: jax.Array) -> jax.Array:
        """uint8 samples to [-1, 1] floats, then to latents when there is an autoencoder."""
        x = to_unit_range(samples)
        return self.autoencoder.encode(x) if self.autoencoder is not None else x

    def conditions_of(self, batch, key=None, variables=None) -> dict[str, jax.Array] | None:
        """The batch's conditions, with rows dropped to unconditional when `key` is given; captions
        are encoded with the text encoders' weights in `variables` (their frozen collections)."""
        if not self.conditional:
            return None
        conditions = {name: batch[name] for name in self.inputs.conditions if name in batch}
        drop = None
        if conditions and key is not None and self.unconditional_prob > 0.0:
            rows = next(iter(conditions.values())).shape[0]
            drop = jax.random.bernoulli(key, self.unconditional_prob, (rows,))
        dropped = {}
        for name, field in self.inputs.conditions.items():
            if hasattr(field, "encode") and name in conditions:  # captions: encoded, dropped to the empty one
                weights = (variables or {}).get(getattr(field, "collection", None))
                dropped.update(field.encode(conditions.pop(name), drop, weights))
        if drop is None:
            return {**conditions, **dropped}
        for name, value in conditions.items():
            if jnp.issubdtype(value.dtype, jnp.integer):
                dropped[name] = jnp.where(drop, -1, value)
            else:
                mask = drop.reshape((rows,) + (1,) * (value.ndim - 1))
                dropped[name] = jnp.where(mask, jnp.zeros_like(value), value)
        return dropped

    def _errors(self, variables, batch, key, drop: bool):
        noise_key, drop_key = jax.random.split(key)
        x0 = self.to_model_space(batch[self.sample_field.key])
        example = self.process.training_example(noise_key, x0)
        x_in, noise_input = self.process.model_input(example.x_t, example.t)
        conditions = self.conditions_of(batch, drop_key if drop else None, variables)
        output = self.model.apply(variables, x_in, noise_input, conditions)
        squared = (output.astype(jnp.float32) - example.target) ** 2
        per_example = jnp.mean(squared.reshape(squared.shape[0], -1), axis=1)
        return per_example, example.weight

    def loss(self, variables, batch, step):
        per_example, weight = self._errors(variables, batch, step.key, drop=True)
        loss = jnp.mean(weight * per_example)
        return loss, Aux(metrics={"mse": jnp.mean(per_example)})

    def evaluate(self, variables, batch, step):
        error_key, sample_key = jax.random.split(step.key)
        per_example, weight = self._errors(variables, batch, error_key, drop=False)
        outputs = {"loss": jnp.mean(weight * per_example), "mse": jnp.mean(per_example)}
        if self.evaluation_steps is not None:
            from dew.sampling.sample import sample
            from dew.sampling.solvers import Heun

            real = batch[self.sample_field.key]
            noise_key, solver_key = jax.random.split(sample_key)
            x_T = self.process.noise(noise_key, (real.shape[0],) + self.model_shape)
            denoise = self.process.denoiser(self.model, variables, self.conditions_of(batch, variables=variables))
            drawn = sample(denoise, x_T, solver=Heun(), steps=self.evaluation_steps, key=solver_key)
            if self.autoencoder is not None:
                drawn = self.autoencoder.decode(drawn)
            outputs["samples"] = jnp.clip(drawn, -1.0, 1.0)
            outputs["images"] = to_unit_range(real)
            outputs.update({name: batch[name] for name, field in self.inputs.conditions.items()
                            if hasattr(field, "encode") and name in batch})  # caption ids, for CLIPScore
        return outputs

    def settings(self) -> dict[str, Any]:
        """What a run record keeps to rebuild this objective around its model."""
        return {"process": self.preset, "inputs": self.inputs, "ema_decay": self.ema_decay,
                "unconditional_prob": self.unconditional_prob, "autoencoder": self.autoencoder,
                "preview_count": self.preview_count, "preview_steps": self.preview_steps,
                "evaluation_steps": self.evaluation_steps}

    def pipeline(self, state, *, ema: bool = True, processor: Any = None) -> TextToImage:
        """A TextToImage task over the trained state (EMA weights when `ema`, raising without)."""
        if processor is not None:
            raise ValueError("A diffusion task conditions on labels or encoders, not a text processor; drop processor=.")
        return self.task(inference_variables(state, ema))

    def task(self, variables) -> TextToImage:
        """A TextToImage task over `variables`."""
        return TextToImage(
            model=self.model,
            variables=variables,
            process=self.process,
            sample_shape=self.model_shape,
            conditions={name: field for name, field in self.inputs.conditions.items()},
            autoencoder=self.autoencoder,
        )

    def preview(self, variables, key, step):
        from dew.eval.image_metrics import image_grid
        from dew.sampling.solvers import Heun

        count = self.preview_count
        task = self.task(variables)
        classes = getattr(self.model, "num_classes", None)
        if "label" in self.inputs.conditions and classes:
            labels = [i % classes for i in range(count)]
        else:
            labels = [None] * count
        result = task(labels, steps=self.preview_steps, solver=Heun(), key=key).host()
        return [Artifact("samples", "image", image_grid(result.uint8()))]


def __getattr__(name: str):
    # Masked-token diffusion for language lives in its own module; the spec imports it from here.
    if name == "MaskedDiffusionObjective":
        from dew.objectives.masked import MaskedDiffusionObjective

        return MaskedDiffusionObjective
    raise AttributeError(f"module 'dew.objectives.diffusion' has no attribute {name!r}")
