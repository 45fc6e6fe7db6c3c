"""Unconditional pixel-space diffusion on Oxford Flowers 102, saved as a run and drawn from reloaded.

Reads the prepared TFDS files (ArrayRecord shards) without TensorFlow; the `tfds` extra pins the
reader. Prepare them once, in an environment of their own with TFDS and TensorFlow
(`pip install "tensorflow-datasets==4.9.10" "tensorflow==2.21.0" scipy importlib_resources`):

    builder = tfds.builder("oxford_flowers102", data_dir=Path.home() / ".cache/dew/datasets")
    builder.download_and_prepare(file_format="array_record")

Then train, checkpoint and save run.json with a `DiffusionRunConfig`, reload the run with
`TextToImage.from_run` and write a sample grid to <run>/samples.png:

    python examples/train_flowers.py --data ~/.cache/dew/datasets/oxford_flowers102/2.1.1 --steps 1000
    python examples/train_flowers.py --data DIR --smoke     # a tiny model and a few steps
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from dew import Checkpoints, Trainer
from dew.config import ModelConfig, TrainerConfig
from dew.data import Loading, TFDSImages
from dew.diffusion import presets
from dew.eval.image_metrics import image_grid
from dew.files import write_atomic
from dew.inference import TextToImage
from dew.nn.backbones import SimpleDiT
from dew.objectives.diffusion import DiffusionRunConfig
from dew.pixels import png_bytes
from dew.sampling import Heun

DEFAULT_DATA = Path.home() / ".cache/dew/datasets/oxford_flowers102/2.1.1"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="the prepared TFDS version directory")
    parser.add_argument("--run", default="runs/flowers64", help="the run directory (checkpoints, run.json, samples.png)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=None)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="a tiny model and a few steps")
    args = parser.parse_args(argv)
    smoke = args.smoke
    steps = args.steps or (2 if smoke else 1000)
    size = args.image_size or (16 if smoke else 64)
    run = Path(args.run)

    config = DiffusionRunConfig(
        model=ModelConfig.from_model(SimpleDiT(patch_size=4, emb_features=32 if smoke else 128,
                                               num_layers=1 if smoke else 4, num_heads=2 if smoke else 4,
                                               dtype=jnp.bfloat16)),
        data=TFDSImages(path=args.data, image_size=size, val_batches=0,
                        loading=Loading(workers=0, threads=1, read_buffer=2)),
        trainer=TrainerConfig(checkpoint_dir=str(run), batch_size=args.batch, steps=steps, keep=1),
        preset=presets.EDM(regime="pixel"),
        text=None,
        steps=8 if smoke else 40,
    )
    objective = config.build()
    checkpoints = Checkpoints(str(run), keep=1)
    state = Trainer(objective, optax.adamw(2e-4), key=jax.random.key(0), checkpoints=checkpoints).fit(
        config.data.load(batch=args.batch, tokenize=objective.inputs.tokenize),
        steps=steps, log_every=max(steps // 20, 1), checkpoint_every=steps)
    checkpoints.wait()
    config.save(run)

    task = TextToImage.from_run(run)
    drawn = task(["a flower"] * args.samples, solver=Heun(), key=jax.random.key(1)).host()
    write_atomic(run / "samples.png", png_bytes(image_grid(drawn.images)))
    result = {"run": str(run), "steps": int(state.updates), "samples": str(run / "samples.png"),
              "shape": list(drawn.images.shape), "files": sorted(path.name for path in run.iterdir())}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
