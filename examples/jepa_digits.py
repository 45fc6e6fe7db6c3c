"""Pretrain an I-JEPA encoder on scikit-learn's digits and probe what it learned.

The 8x8 digits are resized to 64x64 RGB uint8 images (8x8 patches: an 8x8 token grid). The
encoder trains on the train split with no labels; then probes fit on the train split's frozen,
average-pooled target-encoder features and are scored on the held-out split: a linear probe
(logistic regression) and a cosine kNN, with all train labels and with 10 labels per class. The
same probes run on a randomly initialized encoder of the same shape and on the raw pixels, so the
numbers can be read against a floor and a ceiling.

    python examples/jepa_digits.py            # a few minutes on 2 CPU cores
    python examples/jepa_digits.py --smoke    # a tiny run, seconds
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
import optax

from dew import Dataset, Field, Trainer
from dew.data.images import Digits
from dew.eval.probes import effective_rank, feature_std, knn_accuracy, labels_per_class, linear_probe_accuracy
from dew.objectives.jepa import JepaEncoder, JepaObjective, JepaPredictor, MultiBlockMask


def digits(held_out: float = 0.2, seed: int = 0):
    """(train images, train labels, held-out images, held-out labels): uint8 [N, 64, 64, 3]."""
    images, labels = Digits(image_size=64, channels=3).arrays()  # bicubic 8x8 -> 64x64
    order = np.random.default_rng(seed).permutation(len(images))
    cut = int(round(len(images) * (1 - held_out)))
    train, test = order[:cut], order[cut:]
    return images[train], labels[train], images[test], labels[test]


def build(width: int, depth: int, heads: int, targets: int):
    encoder = JepaEncoder(patch_size=8, emb_features=width, num_layers=depth, num_heads=heads)
    predictor = JepaPredictor(
        grid=(8, 8), emb_features=width, predictor_features=width // 2, num_layers=2, num_heads=heads
    )
    mask = MultiBlockMask.for_grid((8, 8), num_targets=targets, scale=(0.15, 0.2), context_scale=(0.85, 1.0))
    return encoder, predictor, mask


def pixels(images: np.ndarray) -> np.ndarray:
    return images.reshape(len(images), -1) / 255.0


def probe(name, train_x, train_y, test_x, test_y) -> dict[str, float]:
    few = labels_per_class(train_y, 10)
    return {
        "features": name,
        "linear": linear_probe_accuracy(train_x, train_y, test_x, test_y),
        "knn": knn_accuracy(train_x, train_y, test_x, test_y, 10),
        "linear_10_per_class": linear_probe_accuracy(train_x[few], train_y[few], test_x, test_y),
        "knn_10_per_class": knn_accuracy(train_x[few], train_y[few], test_x, test_y, 10),
        "effective_rank": float(effective_rank(test_x)),
        "feature_std": float(feature_std(test_x)),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model and a few steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--width", type=int, default=96, help="encoder features (the predictor's are half)")
    parser.add_argument("--depth", type=int, default=4, help="encoder layers")
    parser.add_argument("--targets", type=int, default=4, help="target blocks per image")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    steps = args.steps or (10 if args.smoke else 300)

    train_x, train_y, test_x, test_y = digits(seed=args.seed)
    if args.smoke:
        args.width, args.depth = 32, 1
    heads = 4 if args.width % 4 == 0 else 1
    encoder, predictor, mask = build(args.width, args.depth, heads, args.targets)
    objective = JepaObjective(
        encoder, predictor, mask=mask, sample=Field("image", (64, 64, 3)), momentum_steps=steps
    )
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, steps // 10), steps, args.lr * 0.01)
    trainer = Trainer(objective, optax.adamw(schedule, weight_decay=0.04), key=jax.random.key(args.seed))
    data = Dataset.from_records({"image": train_x}, batch=args.batch, seed=args.seed)
    started = time.time()
    state = trainer.fit(data, steps=steps, log_every=max(1, steps // 10))
    seconds = time.time() - started

    features = jax.jit(objective.features)

    def pooled(variables, images):
        chunks = [features(variables, images[i : i + 256]) for i in range(0, len(images), 256)]
        return np.concatenate([np.asarray(chunk) for chunk in chunks])

    if args.smoke:  # probe a subset: the point is that the program runs
        train_x, train_y, test_x, test_y = train_x[:400], train_y[:400], test_x[:100], test_y[:100]
    random_init = objective.init(jax.random.key(args.seed + 1))
    results = [
        probe("jepa", pooled(state.variables, train_x), train_y, pooled(state.variables, test_x), test_y),
        probe("random_init", pooled(random_init, train_x), train_y, pooled(random_init, test_x), test_y),
        probe("raw_pixels", pixels(train_x), train_y, pixels(test_x), test_y),
    ]
    last = trainer.history[-1]
    print(json.dumps({"steps": steps, "train_seconds": round(seconds, 1), "final_loss": round(last["loss"], 4),
                      "train_effective_rank": round(last["effective_rank"], 2)}))
    for row in results:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
    return results


if __name__ == "__main__":
    main()
