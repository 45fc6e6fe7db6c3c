"""Train an I-JEPA encoder and print linear and kNN probe accuracy on held-out images.

    python recipes/jepa/train.py --help
    python recipes/jepa/train.py --steps 2000                          # scikit-learn digits
    python recipes/jepa/train.py --data path/to/images --image-size 96 --patch-size 8

`--data digits` trains on scikit-learn's digits resized to `--image-size`; any other value is a
folder of images with one subfolder per class (the labels are only used by the probes).
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import numpy as np
import optax
import tyro

from dew import Checkpoints, Dataset, Field, Trainer
from dew.eval.probes import knn_accuracy, labels_per_class, linear_probe_accuracy
from dew.objectives.jepa import JepaEncoder, JepaObjective, JepaPredictor, MultiBlockMask


@dataclasses.dataclass(frozen=True)
class Config:
    """Model, mask, optimization and data settings of one JEPA run."""

    data: str = "digits"
    """'digits', or a folder of images in class subfolders."""
    image_size: int = 64
    held_out: float = 0.2
    """Share of the images kept out of pretraining and used to score the probes."""
    patch_size: int = 8
    width: int = 64
    """Encoder features."""
    depth: int = 4
    """Encoder layers."""
    heads: int = 4
    predictor_width: int = 32
    predictor_depth: int = 2
    num_targets: int = 3
    target_scale: tuple[float, float] = (0.15, 0.2)
    context_scale: tuple[float, float] = (0.85, 1.0)
    aspect: tuple[float, float] = (0.75, 1.5)
    momentum: tuple[float, float] = (0.996, 1.0)
    steps: int = 1000
    batch: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.04
    seed: int = 0
    checkpoints: str | None = None
    """A directory to checkpoint into (and resume from)."""


def load_images(config: Config) -> tuple[np.ndarray, np.ndarray]:
    """All images (uint8 [N, S, S, 3]) and labels (int [N])."""
    if config.data == "digits":
        from dew.data.images import Digits

        return Digits(image_size=config.image_size, channels=3).arrays()
    from dew.data.images import ImageFolder, read_image

    folder = ImageFolder(config.data, image_size=config.image_size)
    files, classes = folder.files(), folder.classes()
    images = np.stack([read_image(folder.root / file, config.image_size) for file in files])
    labels = np.asarray([classes.index(file.split("/")[0]) if "/" in file else 0 for file in files])
    return images, labels


def main(config: Config) -> dict[str, float]:
    images, labels = load_images(config)
    order = np.random.default_rng(config.seed).permutation(len(images))
    cut = int(round(len(images) * (1.0 - config.held_out)))
    train, test = order[:cut], order[cut:]
    grid = (config.image_size // config.patch_size,) * 2
    encoder = JepaEncoder(config.patch_size, config.width, config.depth, config.heads)
    predictor = JepaPredictor(grid, config.width, config.predictor_width, config.predictor_depth, config.heads)
    mask = MultiBlockMask.for_grid(
        grid, config.num_targets, config.target_scale, config.aspect, config.context_scale
    )
    objective = JepaObjective(
        encoder,
        predictor,
        mask=mask,
        sample=Field("image", images.shape[1:]),
        momentum=config.momentum,
        momentum_steps=config.steps,
    )
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.lr, max(1, config.steps // 10), config.steps, config.lr * 0.01
    )
    trainer = Trainer(
        objective,
        optax.adamw(schedule, weight_decay=config.weight_decay),
        key=jax.random.key(config.seed),
        checkpoints=Checkpoints(config.checkpoints) if config.checkpoints else None,
    )
    data = Dataset.from_records({"image": images[train]}, batch=config.batch, seed=config.seed)
    started = time.time()
    state = trainer.fit(
        data,
        steps=config.steps,
        log_every=max(1, config.steps // 20),
        checkpoint_every=(config.steps // 4 or 1) if config.checkpoints else None,
    )
    features = jax.jit(objective.features)
    pooled = np.concatenate(
        [np.asarray(features(state.variables, images[i : i + 256])) for i in range(0, len(images), 256)]
    )
    x, y, x_test, y_test = pooled[train], labels[train], pooled[test], labels[test]
    few = labels_per_class(y, 10, config.seed)
    classes = int(labels.max()) + 1
    results = {
        "train_seconds": round(time.time() - started, 1),
        "linear": linear_probe_accuracy(x, y, x_test, y_test),
        "knn": knn_accuracy(x, y, x_test, y_test, classes),
        "linear_10_per_class": linear_probe_accuracy(x[few], y[few], x_test, y_test),
        "knn_10_per_class": knn_accuracy(x[few], y[few], x_test, y_test, classes),
        **{k: v for k, v in trainer.history[-1].items() if k in ("loss", "effective_rank", "target_std")},
    }
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main(tyro.cli(Config))
