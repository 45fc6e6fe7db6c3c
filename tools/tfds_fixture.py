"""Prepare a tiny image dataset with TensorFlow Datasets itself and record what TFDS reads back.

Writes, read by tests/test_image_data.py:

    tests/fixtures/tfds/dew_toy/1.0.0/   dataset_info.json, features.json and the
                                         dew_toy-{train,test}.array_record-NNNNN-of-MMMMM shards that
                                         `download_and_prepare(file_format="array_record")` writes
    tests/fixtures/tfds/reference.npz    per split, what `builder.as_data_source(split)` decodes
                                         (with TensorFlow) for each record in file order: images,
                                         labels and captions

The builder is shaped like oxford_flowers102's: `image` is a `tfds.features.Image(shape=(None,
None, 3))` fed the paths of JPEG files, so the shards hold the JPEG bytes as they were (flowers
stores its source JPEGs the same way), at sizes that are not square; `image_png` is fed arrays,
which TFDS encodes as PNG; `label` is a ClassLabel and `caption` a Text feature.

Run with an environment that has TFDS and TensorFlow (the versions the README's dataset
preparation names), from anywhere:

    python -m venv /tmp/tfds-env
    /tmp/tfds-env/bin/pip install "tensorflow-datasets==4.9.10" "tensorflow==2.21.0" importlib_resources pillow
    CUDA_VISIBLE_DEVICES="" /tmp/tfds-env/bin/python tools/tfds_fixture.py
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "tfds"
SIZES = [(20, 14), (14, 20), (16, 16), (18, 12)]  # (width, height); flowers' images are not square
WORDS = ["a red flower", "two petals", "a yellow centre", "green leaves", "a blue sky"]


def _examples(split: str, count: int, scratch: pathlib.Path):
    rng = np.random.default_rng({"train": 0, "test": 1}[split])
    for index in range(count):
        width, height = SIZES[index % len(SIZES)]
        # Smooth images, so JPEG keeps them close and a decoder difference stays small.
        y, x = np.mgrid[0:height, 0:width]
        base = rng.integers(0, 256, 3)
        image = (base + 6 * x[..., None] + 4 * y[..., None] * np.array([1, -1, 2])) % 256
        image = image.astype(np.uint8)
        path = scratch / f"{split}-{index}.jpg"
        Image.fromarray(image).save(path, quality=95)
        yield f"{split}-{index}", {
            "image": str(path),
            "image_png": image,
            "label": index % 5,
            "caption": f"{WORDS[index % len(WORDS)]} {index}",
        }


class DewToy(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(None, None, 3)),
                "image_png": tfds.features.Image(shape=(None, None, 3)),
                "label": tfds.features.ClassLabel(num_classes=5),
                "caption": tfds.features.Text(),
            }),
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples("train", 10), "test": self._generate_examples("test", 4)}

    def _generate_examples(self, split: str, count: int):
        yield from _examples(split, count, self.scratch)


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch, tempfile.TemporaryDirectory() as data_dir:
        DewToy.scratch = pathlib.Path(scratch)
        builder = DewToy(data_dir=data_dir, file_format="array_record")
        builder.download_and_prepare()
        prepared = pathlib.Path(builder.data_dir)
        if OUT.exists():
            shutil.rmtree(OUT)
        target = OUT / "dew_toy" / "1.0.0"
        target.mkdir(parents=True)
        for path in prepared.iterdir():
            shutil.copyfile(path, target / path.name)
        arrays = {}
        for split in ("train", "test"):
            source = builder.as_data_source(split=split)
            records = [source[i] for i in range(len(source))]
            for i, record in enumerate(records):
                arrays[f"{split}/image/{i}"] = np.asarray(record["image"])
                arrays[f"{split}/image_png/{i}"] = np.asarray(record["image_png"])
            arrays[f"{split}/label"] = np.asarray([r["label"] for r in records], np.int64)
            arrays[f"{split}/caption"] = np.asarray(
                [r["caption"].decode() if isinstance(r["caption"], bytes) else str(r["caption"])
                 for r in records])
        np.savez(OUT / "reference.npz", **arrays)
    print(f"wrote {OUT}: {sorted(p.name for p in target.iterdir())}")


if __name__ == "__main__":
    main()
