"""Image datasets: a folder of image files (`ImageFolder`), scikit-learn's 8x8 digits (`Digits`) and
a prepared TensorFlow Datasets directory read without TensorFlow (`TFDSImages`).

Every reader yields "image" as uint8 [H, W, C]: each image is cut to the centred square and resized
(PIL, antialiased) to `image_size`. A training stream visits every record once an epoch in an order
drawn from the seed, and decodes only this process's rows of each global batch. Random flips are
keyed by (seed, record, epoch), so a record looks the same at any worker or host count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dew.checks import count, count_fields
from dew.data.dataset import Batch, Dataset, Loading, Partition
from dew.data.tf_example import decode_example

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")

Tokenize = Callable[[list[str]], Any]


# ----------------------------------------------------------------------------------------------
# Decoding and augmenting one image


def fit_square(image, size: int, mode: str = "RGB") -> np.ndarray:
    """A PIL image as uint8 [size, size, C]: the centred square, resized with antialiasing."""
    from PIL import Image

    if image.mode != mode:
        image = image.convert(mode)
    width, height = image.size
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    if (width, height) != (side, side):
        image = image.crop((left, top, left + side, top + side))
    if side != size:
        image = image.resize((size, size), Image.Resampling.BICUBIC)
    array = np.asarray(image, dtype=np.uint8)
    return array[..., None] if array.ndim == 2 else array


def read_image(source: str | os.PathLike | bytes, size: int, *, name: str | None = None) -> np.ndarray:
    """Decode an image file (or its bytes) to uint8 [size, size, 3]; the error names the file."""
    from PIL import Image

    what = name or str(source)
    try:
        opened = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
        with opened as image:
            image.load()
            return fit_square(image, size)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        raise ValueError(
            f"Cannot read the image {what}: {error}. Replace or remove the file (images must be "
            f"JPEG, PNG or WebP)."
        ) from None


def flip_coin(seed: int, record: int, epoch: int) -> bool:
    """A fair coin keyed by (seed, record, epoch): the same answer in every process and worker."""
    digest = hashlib.blake2b(struct.pack("<qqq", seed, record, epoch), digest_size=8).digest()
    return bool(digest[0] & 1)


def natural_key(name: str) -> tuple:
    """Sort key that orders embedded numbers by value ("frame2" before "frame10")."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


# ----------------------------------------------------------------------------------------------
# Streams over records, shared by the readers here and in video.py


class _Tag:
    """Grain map from (position in the repeated stream, record) to [record, epoch]."""

    def __init__(self, records: int):
        self.records = records

    def __call__(self, position: int, record: int) -> np.ndarray:
        return np.asarray([record, position // self.records], dtype=np.int64)


class Rows:
    """Grain map from a global batch of [record, epoch] tags to this process's rows, decoded.

    Subclasses implement `example(record, epoch) -> dict` for one record; state that cannot be
    pickled (open files) is made lazily and left out of the pickle, so worker processes open their own.
    """

    def __init__(self, rows: slice, tokenize: Tokenize | None = None):
        self.rows, self.tokenize = rows, tokenize

    def example(self, record: int, epoch: int) -> dict[str, Any]:
        raise NotImplementedError

    def __call__(self, tags: np.ndarray) -> Batch:
        tags = np.asarray(tags, dtype=np.int64).reshape(-1, 2)[self.rows]
        examples = [self.example(int(record), int(epoch)) for record, epoch in tags]
        batch = {key: np.stack([example[key] for example in examples]) for key in examples[0]}
        return tokenize_captions(batch, self.tokenize)


def tokenize_captions(batch: Batch, tokenize: Tokenize | None) -> Batch:
    """Replace "caption" strings with `tokenize(captions)`: a mapping merged into the batch, or an
    array of ids stored as "text". Without `tokenize`, captions stay a string array."""
    if tokenize is None or "caption" not in batch:
        return batch
    captions = [str(caption) for caption in batch.pop("caption")]
    tokens = tokenize(captions)
    if isinstance(tokens, Mapping):
        batch.update({key: np.asarray(value) for key, value in tokens.items()})
    else:
        batch["text"] = np.asarray(tokens)
    return batch


def train_stream(
    records: int, batch: int, seed: int, rows: Rows, loading: Loading
) -> Iterator[Batch]:
    """A resumable Grain iterator: every record once an epoch, each epoch in a fresh order."""
    import grain

    tags = grain.MapDataset.range(records).shuffle(seed=seed).repeat().map_with_index(_Tag(records))
    # drop_remainder: an infinite stream has no remainder, and Grain's length of batch=1 overflows without it
    return iter(loading.apply(tags.batch(batch, drop_remainder=True).map(rows)))


def val_stream(records: Sequence[int], batch: int, partition: Partition, rows_for) -> Iterator[Batch]:
    """One pass over `records` in order, `batch` at a time, this partition's rows of each.

    `rows_for(slice)` makes the `Rows` decoder. A short last batch that does not split evenly over
    the processes is left out.
    """
    records = list(records)
    for start in range(0, len(records), batch):
        chunk = records[start : start + batch]
        if len(chunk) % partition.count:
            break
        tags = np.asarray([[record, 0] for record in chunk], dtype=np.int64)
        yield rows_for(partition.rows(len(chunk)))(tags)


def split_records(count: int, fraction: float, seed: int, what: str) -> tuple[list[int], list[int]]:
    """Deterministic (train, val) record lists: `fraction` of the records, drawn from `seed`, in order."""
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0 <= fraction < 1:
        raise ValueError(f"{what}.val_fraction must be in [0, 1); got {fraction!r}.")
    held = int(round(count * fraction))
    if fraction > 0:
        held = max(held, 1)
    if held >= count:
        raise ValueError(
            f"{what}.val_fraction={fraction} holds out all {count} records; lower it or add data."
        )
    order = np.random.default_rng(seed).permutation(count)
    return sorted(order[held:].tolist()), sorted(order[:held].tolist())


def _check_loading(value: Any, what: str) -> None:
    if not isinstance(value, Loading):
        raise TypeError(f"{what}.loading must be a Loading; got {value!r}.")


# ----------------------------------------------------------------------------------------------
# ImageFolder


@dataclasses.dataclass(frozen=True)
class ImageFolder:
    """JPEG, PNG and WebP files under `path` (or under `path/split` when `split` names a subfolder).

    With `labels=True` each image sits in a class subfolder; classes are numbered in sorted name
    order and read as "label" (int32). `val_fraction` holds out that share of the images, drawn from
    `seed`, for the validation factory (read in file order, never flipped). `flip=True` mirrors a
    training image when the coin keyed by (seed, image, epoch) says so.

    `caption_file` gives each image a "caption": a JSON object mapping the image's path relative to
    the folder to its text, or JSON lines of {"file": ..., "caption": ...}. `load(tokenize=...)`
    turns captions into token ids.
    """

    path: str
    image_size: int
    split: str | None = None
    val_fraction: float = 0.0
    flip: bool = False
    seed: int = 0
    labels: bool = True
    caption_file: str | None = None
    loading: Loading = Loading()

    def __post_init__(self):
        count_fields(self, image_size=1, seed=0)
        _check_loading(self.loading, "ImageFolder")

    @property
    def root(self) -> Path:
        return Path(self.path) / self.split if self.split else Path(self.path)

    def files(self) -> list[str]:
        """The image paths relative to the folder, in sorted order (hidden files skipped)."""
        root = self.root
        if not root.is_dir():
            raise FileNotFoundError(f"ImageFolder reads a directory of images; {str(root)!r} is not one.")
        found = []
        for directory, subdirs, names in os.walk(root):
            subdirs[:] = [name for name in subdirs if not name.startswith(".")]
            for name in names:
                if not name.startswith(".") and name.lower().endswith(IMAGE_SUFFIXES):
                    found.append(Path(directory, name).relative_to(root).as_posix())
        if not found:
            raise ValueError(
                f"ImageFolder found no images under {root}; expected files ending in "
                f"{', '.join(IMAGE_SUFFIXES)}, in class subfolders when labels=True."
            )
        return sorted(found)

    def classes(self) -> list[str]:
        """The class names (subfolders), in label order."""
        return sorted({file.split("/")[0] for file in self.files() if "/" in file})

    def load(self, batch: int, tokenize: Tokenize | None = None) -> Dataset:
        """A Dataset of "image" (uint8 [S, S, 3]), "label" (int32) when `labels`, and "caption"."""
        batch = count(batch, "ImageFolder.load batch")
        root, files = self.root, self.files()
        labels = None
        if self.labels:
            loose = [file for file in files if "/" not in file]
            if loose:
                raise ValueError(
                    f"ImageFolder(labels=True) reads the class from each image's subfolder, but "
                    f"{root / loose[0]} (and {len(loose) - 1} more) sit directly in {root}; move them "
                    "into class subfolders or pass labels=False."
                )
            names = sorted({file.split("/")[0] for file in files})
            number = {name: index for index, name in enumerate(names)}
            labels = [number[file.split("/")[0]] for file in files]
        captions = _read_captions(self.caption_file, files, root) if self.caption_file else None
        train, val = split_records(len(files), self.val_fraction, self.seed, "ImageFolder")
        paths = [str(root / file) for file in files]
        size, flip, seed, loading = self.image_size, self.flip, self.seed, self.loading

        def train_factory(partition: Partition = Partition()) -> Iterator[Batch]:
            rows = _FolderRows(
                partition.rows(batch), tokenize, [paths[i] for i in train], size,
                None if labels is None else [labels[i] for i in train],
                None if captions is None else [captions[i] for i in train],
                flip, seed, train,
            )
            return train_stream(len(train), batch, seed, rows, loading)

        def val_factory(partition: Partition = Partition()) -> Iterator[Batch]:
            def rows_for(rows):
                return _FolderRows(rows, tokenize, paths, size, labels, captions, False, seed, None)

            return val_stream(val, batch, partition, rows_for)

        return Dataset(
            train=train_factory, val=val_factory if val else None, records=len(train), batch=batch
        )


class _FolderRows(Rows):
    def __init__(self, rows, tokenize, paths, size, labels, captions, flip, seed, ids):
        super().__init__(rows, tokenize)
        self.paths, self.size, self.labels, self.captions = paths, size, labels, captions
        self.flip, self.seed = flip, seed
        self.ids = ids  # the folder-wide index of each record, which keys its flips

    def example(self, record: int, epoch: int) -> dict[str, Any]:
        image = read_image(self.paths[record], self.size)
        if self.flip and flip_coin(self.seed, self.ids[record], epoch):
            image = image[:, ::-1]
        example = {"image": np.ascontiguousarray(image)}
        if self.labels is not None:
            example["label"] = np.int32(self.labels[record])
        if self.captions is not None:
            example["caption"] = np.str_(self.captions[record])
        return example


def _read_captions(caption_file: str, files: list[str], root: Path) -> list[str]:
    path = Path(caption_file)
    if not path.is_file():
        raise FileNotFoundError(f"ImageFolder.caption_file {str(path)!r} is not a file.")
    text = path.read_text(encoding="utf-8")
    try:
        try:
            table = json.loads(text)  # one JSON object
        except json.JSONDecodeError:
            table = None
        if not isinstance(table, dict) or set(table) == {"file", "caption"}:  # JSON lines
            table = {}
            for line in text.splitlines():
                if line.strip():
                    entry = json.loads(line)
                    table[entry["file"]] = entry["caption"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(
            f"Cannot read captions from {path}: {error}. Expected a JSON object mapping image paths "
            'relative to the folder to text, or JSON lines of {"file": ..., "caption": ...}.'
        ) from None
    missing = [file for file in files if file not in table]
    if missing:
        raise ValueError(
            f"{path} has no caption for {root / missing[0]} ({len(missing)} images lack one); "
            f"keys are image paths relative to {root}, such as {missing[0]!r}."
        )
    return [str(table[file]) for file in files]


# ----------------------------------------------------------------------------------------------
# Digits


@dataclasses.dataclass(frozen=True)
class Digits:
    """The 1,797 8x8 handwritten digits that scikit-learn ships (offline), as a small image set.

    Pixels 0..16 become uint8 0..255; `image_size` other than 8 resizes them (bicubic), and
    `channels=3` repeats the grey channel. `val_fraction` of the images, drawn from `seed`, form
    the validation split. Batches hold "image" (uint8 [S, S, channels]) and "label" (int32 0..9).
    """

    image_size: int = 8
    val_fraction: float = 0.2
    seed: int = 0
    channels: int = 1
    loading: Loading = Loading()

    def __post_init__(self):
        count_fields(self, image_size=1, seed=0)
        _check_loading(self.loading, "Digits")
        if self.channels not in (1, 3):
            raise ValueError(f"Digits.channels must be 1 or 3; got {self.channels!r}.")

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """All images (uint8 [N, S, S, channels]) and labels (int32 [N]), in scikit-learn's order."""
        from PIL import Image
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = np.round(digits.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
        if self.image_size != 8:
            images = np.stack(
                [
                    np.asarray(
                        Image.fromarray(image).resize(
                            (self.image_size, self.image_size), Image.Resampling.BICUBIC
                        )
                    )
                    for image in images
                ]
            )
        images = np.repeat(images[..., None], self.channels, axis=-1)
        return images, digits.target.astype(np.int32)

    def load(self, batch: int, tokenize: Tokenize | None = None) -> Dataset:
        """A Dataset of "image" and "label" (`tokenize` is unused: digits have no captions)."""
        batch = count(batch, "Digits.load batch")
        images, labels = self.arrays()
        train, val = split_records(len(images), self.val_fraction, self.seed, "Digits")
        train_columns = {"image": images[train], "label": labels[train]}
        val_columns = {"image": images[val], "label": labels[val]}
        seed, loading = self.seed, self.loading

        def train_factory(partition: Partition = Partition()) -> Iterator[Batch]:
            rows = _ArrayRows(partition.rows(batch), train_columns)
            return train_stream(len(train), batch, seed, rows, loading)

        def val_factory(partition: Partition = Partition()) -> Iterator[Batch]:
            return val_stream(
                range(len(val)), batch, partition, lambda rows: _ArrayRows(rows, val_columns)
            )

        return Dataset(
            train=train_factory, val=val_factory if val else None, records=len(train), batch=batch
        )


class _ArrayRows(Rows):
    def __init__(self, rows, columns: dict[str, np.ndarray]):
        super().__init__(rows)
        self.columns = columns

    def example(self, record: int, epoch: int) -> dict[str, Any]:
        return {key: column[record] for key, column in self.columns.items()}


# ----------------------------------------------------------------------------------------------
# TFDSImages


@dataclasses.dataclass(frozen=True)
class TFDSImages:
    """A split of a prepared TensorFlow Datasets directory in the ArrayRecord format, without TensorFlow.

    `path` is the versioned directory (`.../oxford_flowers102/2.1.1`) holding dataset_info.json,
    features.json and `<name>-<split>.array_record-NNNNN-of-MMMMM` shards of serialized
    tf.train.Example records. The image (PNG or JPEG bytes under `image_key`) becomes "image"
    (uint8 [S, S, 3]); `label_key` (None to skip) becomes "label" (int32); `caption_key` (None by
    default) becomes "caption". The last `val_batches` batches of the split are held out for the
    validation factory.
    """

    path: str
    split: str = "train"
    image_size: int = 64
    val_batches: int = 0
    image_key: str = "image"
    label_key: str | None = "label"
    caption_key: str | None = None
    flip: bool = False
    seed: int = 0
    loading: Loading = Loading()

    def __post_init__(self):
        count_fields(self, image_size=1, seed=0, val_batches=0)
        _check_loading(self.loading, "TFDSImages")

    def shards(self) -> list[str]:
        """The split's ArrayRecord shard files, in order."""
        root = Path(self.path)
        if not (root / "dataset_info.json").is_file():
            raise FileNotFoundError(
                f"TFDSImages reads a prepared TFDS directory holding dataset_info.json; "
                f"{str(root)!r} has none. Point path at the versioned folder (such as "
                ".../oxford_flowers102/2.1.1)."
            )
        info = json.loads((root / "dataset_info.json").read_text())
        name = info.get("name", "*")
        pattern = re.compile(rf"{re.escape(name) if name != '*' else '.+'}-{re.escape(self.split)}"
                             r"\.array_record-(\d+)-of-(\d+)$")
        shards = sorted(p.name for p in root.iterdir() if pattern.match(p.name))
        if not shards:
            splits = [split.get("name") for split in info.get("splits", [])]
            formats = info.get("fileFormat", "tfrecord")
            raise FileNotFoundError(
                f"{root} has no ArrayRecord shards for split {self.split!r} (looked for "
                f"'{name}-{self.split}.array_record-NNNNN-of-MMMMM'); its splits are {splits} and "
                f"its file format is {formats!r}. Prepare it with "
                "tfds.builder(...).download_and_prepare(file_format='array_record')."
            )
        return [str(root / shard) for shard in shards]

    def features(self) -> list[str] | None:
        """The top-level feature names that features.json declares (None when it is absent)."""
        path = Path(self.path) / "features.json"
        if not path.is_file():
            return None
        spec = json.loads(path.read_text())
        features = spec.get("featuresDict", {}).get("features", {})
        return sorted(features) if isinstance(features, dict) else None

    def load(self, batch: int, tokenize: Tokenize | None = None) -> Dataset:
        """A Dataset of "image", "label" (unless label_key is None) and "caption" (with caption_key)."""
        batch = count(batch, "TFDSImages.load batch")
        shards = self.shards()
        declared = self.features()
        keys = {"image_key": self.image_key, "label_key": self.label_key,
                "caption_key": self.caption_key}
        for field, key in keys.items():
            if declared is not None and key is not None and key not in declared:
                hint = " (label_key=None reads no labels)" if field == "label_key" else ""
                raise ValueError(
                    f"TFDSImages.{field}={key!r} is not a feature of {self.path}; its features.json "
                    f"declares {declared}{hint}."
                )
        records = _count_records(shards)
        held = self.val_batches * batch
        if held >= records:
            raise ValueError(
                f"TFDSImages.val_batches={self.val_batches} of {batch} holds out {held} records, but "
                f"split {self.split!r} of {self.path} has {records}; lower val_batches or batch."
            )
        settings = (shards, self.image_size, self.image_key, self.label_key, self.caption_key)
        flip, seed, loading = self.flip, self.seed, self.loading
        train_count = records - held

        def train_factory(partition: Partition = Partition()) -> Iterator[Batch]:
            rows = _ExampleRows(partition.rows(batch), tokenize, *settings, flip, seed)
            return train_stream(train_count, batch, seed, rows, loading)

        def val_factory(partition: Partition = Partition()) -> Iterator[Batch]:
            def rows_for(rows):
                return _ExampleRows(rows, tokenize, *settings, False, seed)

            return val_stream(range(train_count, records), batch, partition, rows_for)

        return Dataset(
            train=train_factory, val=val_factory if held else None, records=train_count, batch=batch
        )


def _count_records(shards: list[str]) -> int:
    import grain

    return len(grain.sources.ArrayRecordDataSource(shards))


class _ExampleRows(Rows):
    def __init__(self, rows, tokenize, shards, size, image_key, label_key, caption_key, flip, seed):
        super().__init__(rows, tokenize)
        self.shards, self.size, self.flip, self.seed = shards, size, flip, seed
        self.image_key, self.label_key, self.caption_key = image_key, label_key, caption_key
        self._source = None

    def __getstate__(self):
        return {**self.__dict__, "_source": None}

    def example(self, record: int, epoch: int) -> dict[str, Any]:
        if self._source is None:
            import grain

            self._source = grain.sources.ArrayRecordDataSource(self.shards)
        source = self.shards[0] if len(self.shards) == 1 else Path(self.shards[0]).parent
        where = f"record {record} of {source}"
        try:
            features = decode_example(self._source[record])
        except (ValueError, IndexError) as error:
            raise ValueError(f"Cannot parse {where} as a tf.train.Example: {error}.") from None
        out = {"image": self._image(features, where)}
        if self.flip and flip_coin(self.seed, record, epoch):
            out["image"] = np.ascontiguousarray(out["image"][:, ::-1])
        if self.label_key is not None:
            out["label"] = np.int32(self._one(features, self.label_key, where))
        if self.caption_key is not None:
            caption = self._one(features, self.caption_key, where)
            text = caption.decode("utf-8") if isinstance(caption, bytes) else str(caption)
            out["caption"] = np.str_(text)
        return out

    def _one(self, features, key, where):
        values = features.get(key)
        if values is None or len(values) == 0:
            raise ValueError(f"{where} has no value for {key!r}; it holds {sorted(features)}.")
        return values[0]

    def _image(self, features, where) -> np.ndarray:
        data = self._one(features, self.image_key, where)
        if not isinstance(data, bytes):
            raise ValueError(
                f"{where}: feature {self.image_key!r} holds numbers, not encoded image bytes."
            )
        return read_image(data, self.size, name=f"{self.image_key!r} in {where}")
