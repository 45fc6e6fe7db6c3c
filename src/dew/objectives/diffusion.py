"""Diffusion and flow-matching training on images and clips.

The objective maps uint8 samples to [-1, 1] (or encodes them to latents with an autoencoder),
draws a noise level from the process, noises the sample, and regresses the backbone's output on the
process's target with the process's weighting. Conditions (labels, embeddings) are dropped per row
with `unconditional_prob`, so the same model also learns the unconditional denoiser that
classifier-free guidance needs: a dropped label becomes -1 (the backbone's null class) and a dropped
embedding becomes zeros.

`DiffusionRunConfig` describes a whole diffusion run (backbone, data, trainer settings, process, a
caption condition, an autoencoder, sampling defaults); it builds the objective and saves the run so
that `TextToImage.from_run` and `dew.pipeline` rebuild its task alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dew.diffusion.presets import as_process
from dew.checks import count
from dew.inference.image import TextToImage, as_autoencoder, as_guidance
from dew.objectives import run_record
from dew.objectives.base import Aux, Field, InputSpec, Objective, inference_variables
from dew.pixels import to_unit_range
from dew.sampling.solvers import Heun
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

    `autoencoder` (latent diffusion) is an `Autoencoder`, or a diffusers AutoencoderKL directory (str or
    path) read with `PretrainedAutoencoder.load`.
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
        # a published scheduler's process (dew.interop.schedulers.SourceProcess) trains as it is
        self.process = process if hasattr(process, "training_example") else as_process(process)
        self.preset = process
        self.inputs = inputs
        self.sample_field = inputs.fields[0]
        self.ema_decay = ema_decay
        self.unconditional_prob = unconditional_prob
        self.autoencoder = as_autoencoder(autoencoder, "DiffusionObjective(autoencoder=)")
        self.preview_count = preview_count
        self.preview_steps = preview_steps
        self.evaluation_steps = evaluation_steps
        self.starting_variables: dict[str, Any] | None = None  # a loaded denoiser's weights (from_pipeline)
        self.null_conditions: dict[str, np.ndarray] = {}  # what a dropped condition becomes (default zeros)
        self.prompts: Any = None  # the prompt encoder conditions_for reads (from_pipeline)
        if self.autoencoder is not None:
            self._check_latents_fit_the_backbone()

    @classmethod
    def from_pipeline(cls, pipeline: Any, image_size: int | tuple[int, int], *, lora: Any = None,
                      key: jax.Array | None = None, train_times: Any = None, unconditional_prob: float = 0.0,
                      ema_decay: float | None = None) -> DiffusionObjective:
        """Fine-tuning of a loaded diffusers pipeline's denoiser (`dew.interop.diffusion_pipelines.
        DiffusionPipeline`) with the source's own training recipe: its scheduler's noise table and
        prediction type, timesteps in its units (`SourceProcess`), its VAE's scaled latents.

        Batches hold "image" (uint8 ``image_size`` pictures) and the denoiser's conditions, which
        `conditions_for(captions)` computes with the pipeline's frozen text encoders. A dropped row
        (``unconditional_prob``, diffusers' ``proportion_empty_prompts``) takes the pipeline's
        unconditional encoding. ``lora`` (a `dew.nn.adapters.LoRA`) trains low-rank factors on the
        projections it names, by their parameter paths (``("to_q", "to_k", "to_v", "to_out_0")`` are
        the attention projections), instead of every weight; the factors are drawn with ``key``.
        ``train_times`` draws the position in the training table (None: uniform, the discrete
        scripts' randint; `LogitNormalTimes()` is SD3's "logit_normal" scheme).
        """
        scheduler = pipeline.scheduler
        if not hasattr(scheduler, "training_process"):
            raise TypeError(
                f"the pipeline's scheduler is a {type(scheduler).__name__}, which has no training side; "
                "fine-tuning needs dew.interop.schedulers.SourceScheduler (the source's rebuilt scheduler)")
        height, width = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        height = count(height, "from_pipeline image height")
        width = count(width, "from_pipeline image width")
        null = {name: np.asarray(value) for name, value in pipeline.prompts.encode_texts([None]).items()}
        conditions = {name: Field(name, value.shape[1:], value.dtype) for name, value in null.items()}
        model, variables = pipeline.denoiser.model, dict(pipeline.denoiser.variables)
        if lora is not None:
            model, variables = _with_lora(model, variables, lora, key)
        objective = cls(model, scheduler.training_process(train_times),
                        InputSpec(Field("image", (height, width, 3)), conditions=conditions),
                        ema_decay=ema_decay, unconditional_prob=unconditional_prob, autoencoder=pipeline.autoencoder)
        objective.starting_variables = variables
        objective.null_conditions = null
        objective.prompts = pipeline.prompts
        return objective

    def conditions_for(self, captions: list[str]) -> dict[str, np.ndarray]:
        """The denoiser's conditions for ``captions`` from the pipeline's frozen text encoders, as
        batch columns (one row per caption)."""
        if self.prompts is None:
            raise ValueError("conditions_for reads a pipeline's prompt encoder; build the objective with "
                             "DiffusionObjective.from_pipeline(pipeline, ...)")
        if isinstance(captions, str) or not captions:
            raise ValueError(f"conditions_for takes a non-empty list of captions; got {captions!r}")
        return {name: np.asarray(value) for name, value in self.prompts.encode_texts(list(captions)).items()}

    def _check_latents_fit_the_backbone(self) -> None:
        """Raise now, before anything compiles, when the backbone cannot take the autoencoder's latents."""
        images = tuple(self.sample_field.shape)
        latents = self.autoencoder.latent_shape(images)
        x = jax.ShapeDtypeStruct((1,) + tuple(latents), jnp.float32)
        noise = jax.ShapeDtypeStruct((1,), jnp.float32)
        conditions = self._condition_examples(1) or None
        try:
            jax.eval_shape(lambda x, noise: self.model.init(jax.random.key(0), x, noise, conditions), x, noise)
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"The autoencoder turns {images} images into {tuple(latents)} latents, which the backbone "
                f"{type(self.model).__name__} cannot take (with conditions {sorted(conditions or {})}): "
                f"{str(error).rstrip('.')}. Pick an autoencoder whose latents fit the backbone (latent_channels, "
                "downsampling), or change the backbone (patch_size, conditions) or the image size."
            ) from None

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
        """The starting weights (a loaded denoiser's) and the text encoders' weights, which a trainer
        passes to `init` as arguments rather than baking them into the compiled init as constants
        (None without either)."""
        encoders = {field.collection: field.encoder.variables for field in self._text_conditions()}
        return {**(self.starting_variables or {}), **encoders} or None

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
        for field in self.inputs.conditions.values():
            if hasattr(field, "tokenize") and field.key not in batch:
                raise ValueError(
                    f"The batch has no caption column {field.key!r} (it has {sorted(batch)}), but the model is "
                    f"conditioned on captions. Give the data captions and load it with "
                    f"tokenize=objective.inputs.tokenize, so {field.key!r} holds int32 token ids [batch, {field.shape[0]}]."
                )
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
                null = self.null_conditions.get(name)
                null = jnp.zeros_like(value) if null is None else jnp.asarray(null, value.dtype)
                dropped[name] = jnp.where(mask, null, value)
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

    @classmethod
    def rebuild(cls, model: Any, settings: dict[str, Any], directory: str | Path, *,
                load_text_encoder: Any, load_autoencoder: Any) -> DiffusionObjective:
        """The objective a run record's `settings` (records already read) describe around `model`.

        A run saved by `DiffusionRunConfig` keeps its text encoder and autoencoder as files in the
        run `directory` (settings["run_files"]); the caller, which sits above the objectives, passes
        the functions that read them: ``load_text_encoder(path, max_length=, truncate=)`` and
        ``load_autoencoder(path)``.
        """
        settings = dict(settings)
        files = settings.pop(RUN_FILES, None) or {}
        if files.get("autoencoder") is not None:
            settings["autoencoder"] = load_autoencoder(Path(directory) / files["autoencoder"])
        text = files.get("text")
        if text is not None:
            from dew.objectives.text_condition import TextCondition

            encoder = load_text_encoder(Path(directory) / text["directory"], max_length=text["max_length"],
                                        truncate=text["truncate"])
            condition = TextCondition(encoder, layer=text["layer"], pooled=text["pooled"], mask=text["mask"],
                                      key=text["key"], truncate=text["truncate"])
            inputs = settings["inputs"]
            settings["inputs"] = InputSpec(*inputs.fields, conditions={**inputs.conditions, condition.key: condition})
        return cls(model, **settings)


def _with_lora(model: Any, variables: dict[str, Any], lora: Any, key: jax.Array | None) -> tuple[Any, dict[str, Any]]:
    """``model`` with low-rank adapters on the kernels of the projections ``lora`` selects (by the
    parameter path, "/" read as "."), and its variables: fresh factors over the frozen weights."""
    from flax import traverse_util

    from dew.nn.adapters import LoRADecoder

    if key is None:
        raise ValueError("LoRA factors are drawn at random: pass key= to from_pipeline")
    flat = traverse_util.flatten_dict(dict(variables["params"]), sep="/")
    targets = tuple(path for path in sorted(flat) if path.endswith("/kernel") and np.ndim(flat[path]) == 2
                    and lora.selects(path[: -len("/kernel")].replace("/", "."), ()))
    if not targets:
        modules = sorted({path.rsplit("/", 2)[-2] for path in flat if path.endswith("/kernel")})
        raise ValueError(f"LoRA modules={lora.modules!r} select no projection of {type(model).__name__}; "
                         f"its projections end in {modules[:12]}")
    adapted = LoRADecoder(model, lora, targets)
    return adapted, {"params": adapted.init_factors(variables["params"], key), "base": variables["params"]}


# --- a diffusion run described in one place ---------------------------------------------------------

RUN_FILES = "run_files"  # objective settings key: the parts a run keeps as files beside run.json
TEXT_ENCODER_DIRECTORY = "text_encoder"
AUTOENCODER_DIRECTORY = "autoencoder"


@dataclasses.dataclass(frozen=True)
class DiffusionRunConfig:
    """A diffusion run in one record: the backbone, the data, the trainer settings, the noise process,
    and optionally a caption condition and an autoencoder, with the task's sampling defaults.

    `build()` makes the `DiffusionObjective`; `save(directory)` writes run.json (the format
    `RunConfig.save` writes) with the text encoder and the autoencoder stored beside it, so
    `TextToImage.from_run(directory)` and `dew.pipeline(directory)` rebuild the task alone.

    Attributes:
      model: the backbone's `ModelConfig` (`ModelConfig.from_model(SimpleDiT(...))`).
      data: the image reader (`TFDSImages`, `ImageFolder`, `Digits`): the sample shape is
        (image_size, image_size, channels) unless `sample_shape` says otherwise.
      trainer: a `TrainerConfig`. preset: a preset or Process (`EDM(regime="pixel")`).
      text: None (unconditional) or a `TextCondition`: its encoder is saved into the run.
      autoencoder: None (pixel space) or an `Autoencoder` that can `save(directory)`
        (`PretrainedAutoencoder`, from `load(directory)` or `from_model(model, variables)`), or a
        diffusers AutoencoderKL directory (str or path), read with `PretrainedAutoencoder.load`.
      optim: an `OptimConfig` to record (None records the default).
      solver, steps, guidance: the task's sampling defaults (`guidance` a CFG, a scale or None).
    """

    model: Any
    data: Any
    trainer: Any
    preset: Any
    text: Any = None
    autoencoder: Any = None
    optim: Any = None
    sample_shape: tuple[int, ...] | None = None
    ema_decay: float | None = 0.999
    unconditional_prob: float = 0.1
    solver: Any = dataclasses.field(default_factory=Heun)
    steps: int = 40
    guidance: Any = None

    def __post_init__(self):
        if not callable(getattr(self.model, "build", None)):
            raise TypeError(
                f"DiffusionRunConfig.model is the backbone's ModelConfig (ModelConfig.from_model(SimpleDiT(...))); "
                f"got {type(self.model).__name__}."
            )
        if self.text is not None and not hasattr(self.text, "encode_texts"):
            raise TypeError(f"DiffusionRunConfig.text is None or a TextCondition; got {type(self.text).__name__}.")
        object.__setattr__(self, "autoencoder", as_autoencoder(self.autoencoder, "DiffusionRunConfig.autoencoder"))
        if self.autoencoder is not None and not callable(getattr(self.autoencoder, "save", None)):
            raise TypeError(
                f"DiffusionRunConfig.autoencoder is stored with the run, so it needs save(directory); "
                f"{type(self.autoencoder).__name__} has none. Wrap a trained AutoencoderKL as "
                "PretrainedAutoencoder.from_model(model, variables), or load one with PretrainedAutoencoder.load."
            )
        object.__setattr__(self, "guidance", as_guidance(self.guidance))
        object.__setattr__(self, "steps", count(self.steps, "DiffusionRunConfig.steps"))

    def image_shape(self) -> tuple[int, ...]:
        """The shape of one training image: `sample_shape`, or the data's image_size and channels."""
        if self.sample_shape is not None:
            return tuple(self.sample_shape)
        size = getattr(self.data, "image_size", None)
        if size is None:
            raise ValueError(
                f"DiffusionRunConfig cannot tell the image shape: {type(self.data).__name__} has no image_size. "
                "Pass sample_shape=(height, width, channels)."
            )
        return (size, size, getattr(self.data, "channels", 3))

    def build(self) -> DiffusionObjective:
        """The objective this run trains."""
        conditions = {} if self.text is None else {self.text.key: self.text}
        return DiffusionObjective(
            self.model.build(), self.preset, InputSpec(Field("image", self.image_shape()), conditions=conditions),
            ema_decay=self.ema_decay, unconditional_prob=self.unconditional_prob, autoencoder=self.autoencoder,
        )

    def save(self, directory: str | Path) -> Path:
        """Write the run's text encoder and autoencoder into `directory`, then run.json (atomically, last,
        so a run.json never names files that are not there). Returns run.json's path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        objective = self.build()
        settings = objective.settings()
        settings["autoencoder"] = None
        settings["inputs"] = InputSpec(objective.sample_field, conditions={
            name: field for name, field in objective.inputs.conditions.items() if field is not self.text})
        files: dict[str, Any] = {}
        if self.autoencoder is not None:
            self.autoencoder.save(directory / AUTOENCODER_DIRECTORY, overwrite=True)
            files["autoencoder"] = AUTOENCODER_DIRECTORY
        if self.text is not None:
            text = self.text
            # the encoder's files with the condition's tokenizer, which may differ from the encoder's own
            dataclasses.replace(text.encoder, tokens=text.tokens).save(directory / TEXT_ENCODER_DIRECTORY, overwrite=True)
            files["text"] = {"directory": TEXT_ENCODER_DIRECTORY, "max_length": text.tokens.max_length,
                             "truncate": text.tokens.truncate, "layer": text.layer, "pooled": text.pooled,
                             "mask": text.mask, "key": text.key}
        if files:
            settings[RUN_FILES] = files
        sampling = {"solver": self.solver, "steps": self.steps, "guidance": self.guidance}
        return run_record.write(directory, model=self.model, data=self.data, optim=self.optim, trainer=self.trainer,
                                objective_class=DiffusionObjective, objective_settings=settings, sampling=sampling)


def __getattr__(name: str):
    # Masked-token diffusion for language lives in its own module; the spec imports it from here.
    if name == "MaskedDiffusionObjective":
        from dew.objectives.masked import MaskedDiffusionObjective

        return MaskedDiffusionObjective
    raise AttributeError(f"module 'dew.objectives.diffusion' has no attribute {name!r}")
