"""Train an image diffusion model (a DiT) and save it as a run that `dew.pipeline` reloads.

    python recipes/diffusion/train.py --help
    python recipes/diffusion/train.py                              # scikit-learn's digits, by label
    python recipes/diffusion/train.py --data.images path/to/images --data.image-size 64 --preset edm
    python recipes/diffusion/train.py --config runs/dit/recipe.json --trainer.steps 20000

`--data.images digits` trains on the 1,797 digits scikit-learn ships (offline); any other value is
a folder of images, in one subfolder per class when `--data.labels` (the default), which makes the
model class-conditional with classifier-free guidance. The run trains with `RunConfig.train` in
`<trainer.checkpoint-dir>/<trainer.name>`, then is reloaded and draws one sample per class into
`<run>/samples.png`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Literal

from dew.config import ModelConfig, OptimConfig, RunConfig, TrainerConfig
from dew.config.command_line import parse, save_recipe
from dew.config.train import run_directory


@dataclasses.dataclass(frozen=True)
class DiT:
    """The denoiser (a SimpleDiT over image patches)."""

    patch_size: int = 4
    """Pixels per patch side; the image size must be a multiple of it."""
    emb_features: int = 128
    num_layers: int = 4
    num_heads: int = 4
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype; the weights stay float32."""


@dataclasses.dataclass(frozen=True)
class Images:
    """The training images."""

    images: str = "digits"
    """'digits' (scikit-learn's, offline), or a folder of images."""
    image_size: int = 32
    """Images are resized to this square size."""
    channels: Literal[1, 3] = 3
    """Colour channels (digits only; a folder is read as RGB)."""
    labels: bool = True
    """Condition on the class (digits' label, or the folder's class subfolders)."""
    val_fraction: float = 0.1
    """Share of the images held out for the validation loss."""
    flip: bool = False
    """Mirror training images at random (a folder only)."""
    seed: int = 0
    """Draws the held-out split and the epoch order."""



@dataclasses.dataclass(frozen=True)
class DiffusionRecipe:
    """Train a class-conditional (or unconditional) image diffusion model and save it as a run."""

    model: DiT = DiT()
    data: Images = Images()
    preset: Literal["flow", "edm", "cosine", "karras", "sqrt"] = "flow"
    """The noising process: rectified flow, EDM, cosine (DDPM), Karras or sqrt schedules."""
    optim: OptimConfig = OptimConfig(optimizer="adamw", learning_rate=3e-4, weight_decay=0.0, b2=0.99,
                                     warmup_steps=100, clip_norm=1.0)
    trainer: TrainerConfig = TrainerConfig(name="dit", checkpoint_dir="runs", steps=3000, batch_size=64,
                                           log_every=100, eval_every=1000, checkpoint_every=1000, keep=1)
    ema_decay: float | None = 0.999
    """Keep an averaged copy of the weights with this decay; samples use it (None keeps none)."""
    unconditional_prob: float = 0.1
    """Share of training examples whose label is dropped, for classifier-free guidance."""
    sample_steps: int = 32
    """Solver steps for the samples drawn at the end."""


def main(recipe: DiffusionRecipe) -> Path:
    recipe.trainer.apply_xla_flags()  # before anything starts JAX's backend

    import jax.numpy as jnp

    import dew
    from dew import Field, InputSpec
    from dew.diffusion import presets
    from dew.eval.image_metrics import image_grid
    from dew.files import write_atomic
    from dew.nn.backbones import SimpleDiT
    from dew.objectives.diffusion import DiffusionObjective
    from dew.pixels import png_bytes

    run = run_directory(recipe.trainer, recipe.trainer.name)
    run.mkdir(parents=True, exist_ok=True)
    save_recipe(recipe, run)
    data, classes, channels = _images(recipe.data)
    shape = recipe.model
    model = SimpleDiT(patch_size=shape.patch_size, emb_features=shape.emb_features, num_layers=shape.num_layers,
                      num_heads=shape.num_heads, num_classes=classes or None, dtype=jnp.dtype(shape.dtype))
    size = recipe.data.image_size
    conditions = {"label": Field("label", ())} if classes else {}
    process = {"flow": presets.Flow, "edm": presets.EDM, "cosine": presets.Cosine, "karras": presets.Karras,
               "sqrt": presets.Sqrt}[recipe.preset]()
    objective = DiffusionObjective(model, process, InputSpec(Field("image", (size, size, channels)), conditions=conditions),
                                   ema_decay=recipe.ema_decay, unconditional_prob=recipe.unconditional_prob)
    config = RunConfig(model=ModelConfig.from_model(model), data=data, optim=recipe.optim, trainer=recipe.trainer)
    state = config.train(objective)

    task = dew.pipeline(run, ema=recipe.ema_decay is not None)  # the run alone rebuilds the model
    drawn = task(list(range(min(classes, 16))) if classes else [None] * 16, steps=recipe.sample_steps, seed=0)
    samples = write_atomic(run / "samples.png", png_bytes(image_grid(drawn.host().images)))
    print(json.dumps({"run": str(run), "step": int(state.step), "samples": str(samples)}))
    return run


def _images(settings: Images):
    """The data spec the run records, its number of classes (0 without labels) and its channels."""
    from dew.data.images import Digits, ImageFolder

    if settings.images == "digits":
        data = Digits(image_size=settings.image_size, channels=settings.channels, val_fraction=settings.val_fraction,
                      seed=settings.seed)
        return data, 10 if settings.labels else 0, settings.channels
    data = ImageFolder(settings.images, image_size=settings.image_size, val_fraction=settings.val_fraction,
                       flip=settings.flip, seed=settings.seed, labels=settings.labels)
    return data, len(data.classes()) if settings.labels else 0, 3


if __name__ == "__main__":
    main(parse(DiffusionRecipe, sys.argv[1:]))
