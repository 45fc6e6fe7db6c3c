"""diffusers pipeline directories: model_index.json and the components it names.

A pipeline directory (``stabilityai/stable-diffusion-xl-base-1.0`` and the like) holds
model_index.json beside one folder per component. model_index.json names the pipeline class and,
for each component, the (library, class) that reads its folder:

    {"_class_name": "StableDiffusionXLPipeline", "force_zeros_for_empty_prompt": true,
     "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
     "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"], ...}

`read_model_index` reads it; `load_prompts` builds the family's prompt encoder (text encoders
and tokenizers, `dew.interop.pipeline_prompts`); `DiffusionPipeline.load` adds the autoencoder,
the denoiser and the scheduler. Denoisers and schedulers load through the `DENOISERS` and
`SCHEDULERS` registries (diffusers class name -> loader); a class without one raises naming
those Dew reads. Schedulers are the source's own, rebuilt by `dew.interop.schedulers.SourceScheduler`
from scheduler_config.json. `DiffusionPipeline.text_to_image()` assembles the `TextToImage` task
(what `dew.pipeline(dir)` returns) and `DiffusionPipeline.save(dir)` writes the directory back.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from dew.data.caption_tokens import CaptionTokens
from dew.data.clip_bpe import clip_bpe, has_clip_bpe_files
from dew.data.tokenizers import HFTokenizer
from dew.files import staged_directory
from dew.hub import local_directory
from dew.interop.autoencoders import CLASS_NAME as AUTOENCODER_CLASS
from dew.interop.autoencoders import PretrainedAutoencoder
from dew.interop import flux_transformer, sd3_transformer, unet_condition
from dew.interop.pipeline_prompts import FluxPrompts, SD3Prompts, SDXLPrompts, StableDiffusionPrompts
from dew.interop.schedulers import DEFAULTS as SOURCE_SCHEDULERS
from dew.interop.schedulers import SourceScheduler
from dew.interop.text_encoders import PretrainedTextEncoder

MODEL_INDEX = "model_index.json"
DEFAULT = object()  # text_to_image's guidance= left out: the pipeline's own
CONFIG_FILE = "config.json"
SCHEDULER_CONFIG = "scheduler_config.json"
TEXT_ENCODERS = ("CLIPTextModel", "CLIPTextModelWithProjection", "T5EncoderModel")
TOKENIZERS = ("CLIPTokenizer", "CLIPTokenizerFast", "T5Tokenizer", "T5TokenizerFast")


@dataclasses.dataclass(frozen=True)
class Family:
    """What a pipeline class is made of: its text encoder folders (with the tokenizer folder each
    reads), the folder of its denoiser, and the length T5 encodes to (None without T5)."""

    encoders: tuple[tuple[str, str], ...]
    denoiser: str
    guidance: float | None  # the pipeline's default classifier-free guidance scale (None: off)
    steps: int  # its default number of inference steps
    t5_length: int | None = None
    optional: tuple[str, ...] = ()  # encoder folders a checkpoint may leave out ([null, null])


_SDXL = (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"))
PIPELINES: dict[str, Family] = {
    "StableDiffusionPipeline": Family((("text_encoder", "tokenizer"),), "unet", guidance=7.5, steps=50),
    "StableDiffusionImg2ImgPipeline": Family((("text_encoder", "tokenizer"),), "unet", guidance=7.5, steps=50),
    "StableDiffusionInpaintPipeline": Family((("text_encoder", "tokenizer"),), "unet", guidance=7.5, steps=50),
    "StableDiffusionXLPipeline": Family(_SDXL, "unet", guidance=5.0, steps=50),
    "StableDiffusionXLImg2ImgPipeline": Family(_SDXL, "unet", guidance=5.0, steps=50, optional=("text_encoder",)),
    "StableDiffusionXLInpaintPipeline": Family(_SDXL, "unet", guidance=7.5, steps=50, optional=("text_encoder",)),
    "StableDiffusion3Pipeline": Family(_SDXL + (("text_encoder_3", "tokenizer_3"),), "transformer", guidance=7.0,
                                       steps=28, t5_length=256, optional=("text_encoder_3",)),
    # Flux is guidance-distilled: its guidance scale is a condition of the transformer (FluxPrompts)
    "FluxPipeline": Family(_SDXL, "transformer", guidance=None, steps=28, t5_length=512),
}

# diffusers class name -> loader(folder, *, dtype, param_dtype) returning a bundle with `model`,
# `variables` and `config` (as `Pretrained<Name>.load` of the denoiser modules).
DENOISERS: dict[str, Callable[..., Any]] = {
    unet_condition.CLASS_NAME: unet_condition.PretrainedUNet.load,
    sd3_transformer.CLASS_NAME: sd3_transformer.PretrainedSD3Transformer.load,
    flux_transformer.CLASS_NAME: flux_transformer.PretrainedFluxTransformer.load,
}
# diffusers class name -> loader(config: the scheduler_config.json dict, **pipeline options) returning
# Dew's scheduler: an object with `process` (noise and the denoiser wrapper `TextToImage` samples
# through) and `solver`. Every class `SourceScheduler` rebuilds reads through it.
SCHEDULERS: dict[str, Callable[..., Any]] = {name: SourceScheduler.from_config for name in SOURCE_SCHEDULERS}
# what a pipeline class itself does around its scheduler: FluxPipeline passes the sigmas
# linspace(1, 1/steps, steps) and hands its transformer timesteps / 1000
SCHEDULER_OPTIONS: dict[str, dict[str, Any]] = {
    "FluxPipeline": {"pipeline_sigmas": "flux", "model_timestep_scale": 0.001},
}


# --- model_index.json -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelIndex:
    """A parsed model_index.json.

    Attributes:
      directory: the pipeline directory.
      pipeline_class: ``_class_name`` (``"StableDiffusionXLPipeline"``).
      components: folder -> (library, class), for the components the checkpoint holds (entries
        written ``[null, null]``, such as a removed safety checker, are left out).
      settings: the pipeline's own settings (``force_zeros_for_empty_prompt``,
        ``requires_aesthetics_score``, ...).
    """

    directory: Path
    pipeline_class: str
    components: Mapping[str, tuple[str, str]]
    settings: Mapping[str, Any]

    @property
    def family(self) -> Family:
        return PIPELINES[self.pipeline_class]

    def folder(self, name: str) -> Path:
        """The component folder ``name``; raises when model_index.json or the directory lacks it."""
        if name not in self.components:
            raise FileNotFoundError(
                f"{self.directory / MODEL_INDEX} names no {name!r} component (it names {sorted(self.components)}); "
                f"a {self.pipeline_class} needs one"
            )
        path = self.directory / name
        if not path.is_dir():
            raise FileNotFoundError(
                f"{self.directory / MODEL_INDEX} names the component {name!r} ({'.'.join(self.components[name])}) "
                f"but {path} does not exist; download the whole pipeline repository"
            )
        return path

    def config(self, name: str, file: str = CONFIG_FILE) -> dict[str, Any]:
        path = self.folder(name) / file
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; the {name!r} component folder holds its settings there")
        return json.loads(path.read_text())


def read_model_index(directory: str | Path, *, revision: str | None = None) -> ModelIndex:
    """Parse ``directory``/model_index.json (a local pipeline directory or a Hub id in the cache)."""
    path = local_directory(directory, revision=revision, what="diffusers pipeline")
    index_path = path / MODEL_INDEX
    if not index_path.is_file():
        present = sorted(p.name for p in path.iterdir())[:12]
        raise FileNotFoundError(
            f"{path} holds no {MODEL_INDEX}, so it is not a diffusers pipeline directory; it holds {present}"
        )
    raw = json.loads(index_path.read_text())
    pipeline_class = raw.get("_class_name")
    if pipeline_class not in PIPELINES:
        raise ValueError(
            f"{index_path} names the pipeline class {pipeline_class!r}; Dew reads {sorted(PIPELINES)}"
        )
    components, settings = {}, {}
    for key, value in raw.items():
        if key.startswith("_"):
            continue
        if isinstance(value, list) and len(value) == 2 and all(part is None or isinstance(part, str) for part in value):
            if value[0] is not None and value[1] is not None:
                components[key] = (value[0], value[1])
        else:
            settings[key] = value
    return ModelIndex(directory=path, pipeline_class=pipeline_class, components=components, settings=settings)


# --- text encoders and tokenizers -----------------------------------------------------------------


def caption_tokens(folder: Path, max_length: int) -> CaptionTokens:
    """The tokenizer a pipeline folder holds, as fixed-length caption rows: tokenizer.json (a fast
    tokenizer, as T5's folders ship), or CLIP's vocab.json + merges.txt."""
    if (folder / "tokenizer.json").is_file():
        return CaptionTokens(HFTokenizer(folder), max_length)
    if has_clip_bpe_files(folder):
        backend, config = clip_bpe(folder)
        return CaptionTokens(HFTokenizer(folder, backend=backend, config=config), max_length)
    present = sorted(p.name for p in folder.iterdir())[:12]
    raise FileNotFoundError(
        f"{folder} holds no tokenizer Dew reads: it needs tokenizer.json, or vocab.json + merges.txt "
        f"(CLIPTokenizer); it holds {present}. A T5 folder with spiece.model alone can be converted with "
        "transformers (T5TokenizerFast.from_pretrained(folder).save_pretrained(folder)) to add tokenizer.json"
    )


def _clip_length(index: ModelIndex, tokenizer: str, encoder: PretrainedTextEncoder) -> int:
    """The tokenizer's model_max_length, as the pipelines pad CLIP prompts to (77 in the releases)."""
    settings_path = index.folder(tokenizer) / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
    length = settings.get("model_max_length")
    context = encoder.model.max_position_embeddings
    return length if isinstance(length, int) and length <= context else context


def load_text_encoder(index: ModelIndex, name: str, tokenizer: str, *, t5_length: int | None,
                      dtype: Any = jnp.float32, param_dtype: Any = jnp.float32) -> PretrainedTextEncoder:
    """Text encoder ``name`` with the tokenizer of folder ``tokenizer`` attached."""
    library, cls = index.components.get(name, ("", ""))
    if name in index.components and (library, cls) not in {("transformers", c) for c in TEXT_ENCODERS}:
        raise ValueError(f"{index.directory / MODEL_INDEX} gives {name} as {library}.{cls}; Dew reads "
                         f"transformers' {list(TEXT_ENCODERS)}")
    tokenizer_library, tokenizer_cls = index.components.get(tokenizer, ("", ""))
    if tokenizer in index.components and tokenizer_cls not in TOKENIZERS:
        raise ValueError(f"{index.directory / MODEL_INDEX} gives {tokenizer} as {tokenizer_library}.{tokenizer_cls}; "
                         f"Dew reads {list(TOKENIZERS)}")
    encoder = PretrainedTextEncoder.load(index.folder(name), dtype=dtype, param_dtype=param_dtype)
    if hasattr(encoder.model, "eos_token_id"):  # CLIP
        length = _clip_length(index, tokenizer, encoder)
    else:
        if t5_length is None:
            raise ValueError(f"{index.pipeline_class} has no T5 text encoder, but {index.folder(name)} holds one")
        length = t5_length
    return dataclasses.replace(encoder, tokens=caption_tokens(index.folder(tokenizer), length))


def _size_defaults(index: ModelIndex) -> tuple[int, int]:
    """The pipeline's default image side in pixels: the denoiser's sample_size times the VAE's downsampling."""
    blocks = index.config("vae").get("block_out_channels") or [0]
    side = int(index.config(index.family.denoiser).get("sample_size") or 128) * 2 ** (len(blocks) - 1)
    return side, side


def load_prompts(directory: str | Path | ModelIndex, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
                 revision: str | None = None, **options: Any) -> Any:
    """The pipeline's prompt encoder (`StableDiffusionPrompts`, `SDXLPrompts`, `SD3Prompts` or
    `FluxPrompts`), with its text encoders and tokenizers loaded. ``options`` pass on to it
    (``max_sequence_length=``, SDXL's ``original_size=``, Flux's ``guidance=``, ...)."""
    index = directory if isinstance(directory, ModelIndex) else read_model_index(directory, revision=revision)
    family = index.family
    length = options.get("max_sequence_length", family.t5_length)
    encoders = {}
    for name, tokenizer in family.encoders:
        if name not in index.components and name in family.optional:
            encoders[name] = None
            continue
        encoders[name] = load_text_encoder(index, name, tokenizer, t5_length=length, dtype=dtype, param_dtype=param_dtype)
    cls = index.pipeline_class
    if cls in ("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline"):
        return StableDiffusionPrompts(encoders["text_encoder"], **options)
    if cls in ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline", "StableDiffusionXLInpaintPipeline"):
        settings = dict(force_zeros_for_empty_prompt=index.settings.get("force_zeros_for_empty_prompt", True))
        if index.settings.get("requires_aesthetics_score", False):
            settings.update(aesthetic_score=6.0, negative_aesthetic_score=2.5)
        settings["original_size"] = _size_defaults(index)
        return SDXLPrompts(encoders["text_encoder"], encoders["text_encoder_2"], **{**settings, **options})
    if cls == "StableDiffusion3Pipeline":
        if encoders["text_encoder_3"] is None:
            options.setdefault("joint_attention_dim", index.config("transformer").get("joint_attention_dim", 4096))
        return SD3Prompts(encoders["text_encoder"], encoders["text_encoder_2"], encoders["text_encoder_3"], **options)
    guidance = 3.5 if index.config("transformer").get("guidance_embeds") else None
    return FluxPrompts(encoders["text_encoder"], encoders["text_encoder_2"], **{"guidance": guidance, **options})


# --- denoiser and scheduler -----------------------------------------------------------------------


def load_denoiser(index: ModelIndex, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32) -> Any:
    """The pipeline's UNet or transformer, through the `DENOISERS` loader of its class."""
    name = index.family.denoiser
    folder = index.folder(name)
    cls = index.components[name][1]
    if cls not in DENOISERS:
        raise NotImplementedError(
            f"{index.directory} is a {index.pipeline_class} whose {name} is a diffusers {cls}; Dew has no "
            f"loader for that denoiser yet (it reads {sorted(DENOISERS) or 'none so far'})"
        )
    return DENOISERS[cls](folder, dtype=dtype, param_dtype=param_dtype)


def load_scheduler(index: ModelIndex) -> Any:
    """The pipeline's scheduler, rebuilt by the `SCHEDULERS` entry of its class from scheduler_config.json."""
    cls = index.components.get("scheduler", (None, None))[1]
    config = index.config("scheduler", SCHEDULER_CONFIG)
    if cls not in SCHEDULERS:
        raise NotImplementedError(
            f"{index.directory} uses the diffusers scheduler {cls}; Dew has no rebuild of it yet "
            f"(it reads {sorted(SCHEDULERS) or 'none so far'})"
        )
    return SCHEDULERS[cls](config, **SCHEDULER_OPTIONS.get(index.pipeline_class, {}))


def load_autoencoder(index: ModelIndex, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32) -> PretrainedAutoencoder:
    cls = index.components.get("vae", (None, None))[1]
    if cls != AUTOENCODER_CLASS:
        raise ValueError(f"{index.directory / MODEL_INDEX} gives the vae as {cls}; Dew reads {AUTOENCODER_CLASS}")
    return PretrainedAutoencoder.load(index.folder("vae"), dtype=dtype, param_dtype=param_dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class DiffusionPipeline:
    """Every component of a diffusers pipeline directory, loaded.

    Attributes:
      index: its `ModelIndex`.
      prompts: the family's prompt encoder (`load_prompts`).
      autoencoder: the `PretrainedAutoencoder` of vae/.
      denoiser: what the `DENOISERS` loader returned for unet/ or transformer/.
      scheduler: what the `SCHEDULERS` loader returned for scheduler/.
    """

    index: ModelIndex
    prompts: Any
    autoencoder: PretrainedAutoencoder
    denoiser: Any
    scheduler: Any

    @classmethod
    def load(cls, directory: str | Path, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
             revision: str | None = None) -> "DiffusionPipeline":
        """Read a pipeline directory (or a Hub id's snapshot in the local cache). The denoiser and the
        scheduler are checked first, so an unsupported one fails before any weights are read."""
        index = read_model_index(directory, revision=revision)
        denoiser_class = index.components.get(index.family.denoiser, (None, None))[1]
        if denoiser_class not in DENOISERS:
            load_denoiser(index)  # raises, naming the class
        if index.components.get("scheduler", (None, None))[1] not in SCHEDULERS:
            load_scheduler(index)  # raises, naming the class
        return cls(index=index, prompts=load_prompts(index, dtype=dtype, param_dtype=param_dtype),
                   autoencoder=load_autoencoder(index, dtype=dtype, param_dtype=param_dtype),
                   denoiser=load_denoiser(index, dtype=dtype, param_dtype=param_dtype), scheduler=load_scheduler(index))

    def save(self, directory: str | Path, *, overwrite: bool = False, dtype: Any = None) -> Path:
        """Write the pipeline directory back as diffusers reads it: model_index.json as loaded, each
        text encoder, the VAE and the denoiser through their own ``save`` (``dtype`` casts the
        weights), scheduler/scheduler_config.json from the scheduler's settings, and the tokenizer
        folders (and any component Dew does not hold) copied unchanged from the source directory.
        Files are staged beside ``directory`` and renamed into place at the end; a non-empty
        ``directory`` is replaced only with ``overwrite=True``."""
        source = self.index.directory
        dest = Path(directory).expanduser()
        if dest.resolve() == source.resolve():
            raise ValueError(f"{dest} is the directory this pipeline was read from; save to another directory")
        encoders = {name for name, _ in self.index.family.encoders}
        tokenizers = {tokenizer for _, tokenizer in self.index.family.encoders}
        with staged_directory(dest, overwrite=overwrite) as staging:
            (staging / MODEL_INDEX).write_text((source / MODEL_INDEX).read_text())
            for name in self.index.components:
                target = staging / name
                if name in encoders:
                    encoder = getattr(self.prompts, name, None)
                    if encoder is None:  # an optional encoder this pipeline was read without
                        raise ValueError(f"{source} names {name}, but the loaded pipeline holds no {name} to save")
                    dataclasses.replace(encoder, tokens=None).save(target, dtype=dtype)
                elif name == "vae":
                    self.autoencoder.save(target, dtype=dtype)
                elif name == self.index.family.denoiser:
                    self.denoiser.save(target, dtype=dtype)
                elif name == "scheduler":
                    target.mkdir()
                    config = self.scheduler.to_config()
                    (target / SCHEDULER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
                elif name in tokenizers or (source / name).is_dir():
                    shutil.copytree(self.index.folder(name), target)
        return dest

    def text_to_image(self, *, height: int | None = None, width: int | None = None, steps: int | None = None,
                      guidance: Any = DEFAULT) -> Any:
        """The `TextToImage` task this pipeline serves: images ``height`` x ``width`` pixels (default
        the pipeline's own size), ``steps`` and ``guidance`` defaulting to the pipeline's. For a
        guidance-distilled Flux, ``guidance`` is the scale its transformer reads, not classifier-free
        guidance (FluxPipeline's ``guidance_scale``)."""
        from dew.inference.image import TextToImage

        default_height, default_width = _size_defaults(self.index)
        family = self.index.family
        sample = (height or default_height, width or default_width, self.autoencoder.model.in_channels)
        latent_shape = tuple(self.autoencoder.latent_shape(sample))
        scheduler = self._scheduler_for(latent_shape)
        prompts = self.prompts
        if family.guidance is None:
            prompts = self._distilled_guidance(guidance)
            guidance = None
        return TextToImage(
            model=self.denoiser.model, variables=self.denoiser.variables, process=scheduler.process,
            solver=scheduler.solver, sample_shape=latent_shape, conditions={"prompt": prompts},
            autoencoder=self.autoencoder, guidance=family.guidance if guidance is DEFAULT else guidance,
            steps=steps or family.steps,
        )

    def __call__(self, prompts: Any, **options: Any) -> Any:
        """Draw images for ``prompts`` with the pipeline's defaults (``text_to_image()(prompts, **options)``)."""
        return self.text_to_image()(prompts, **options)

    def _scheduler_for(self, latent_shape: tuple[int, ...]) -> Any:
        """The scheduler with the latent token count a flow scheduler's dynamic shifting reads: the
        latents cut into 2 x 2 patches (Flux packs them so; SD3 reads its transformer's patch_size)."""
        if not isinstance(self.scheduler, SourceScheduler) or self.scheduler.space != "flow":
            return self.scheduler
        patch = 2 if self.index.pipeline_class == "FluxPipeline" else int(
            self.index.config(self.index.family.denoiser).get("patch_size", 2))
        tokens = (latent_shape[0] // patch) * (latent_shape[1] // patch)
        return dataclasses.replace(self.scheduler, image_tokens=tokens)

    def _distilled_guidance(self, guidance: Any) -> Any:
        """The prompt encoder with ``guidance`` as the embedded scale of a guidance-distilled model."""
        if guidance is DEFAULT or guidance is None:
            return self.prompts
        if getattr(self.prompts, "guidance", None) is None:
            raise ValueError(f"{self.index.directory} is a {self.index.pipeline_class} whose transformer has no "
                             f"guidance embedding (guidance_embeds false), so guidance={guidance!r} has no effect; "
                             "leave guidance unset")
        if not isinstance(guidance, (int, float)) or isinstance(guidance, bool):
            raise TypeError(f"guidance for a {self.index.pipeline_class} is the scale its transformer reads, a "
                            f"float; got {guidance!r}")
        prompts = copy.copy(self.prompts)
        prompts.guidance = float(guidance)
        return prompts
