"""Video clips from folders of frame images, read as windows of consecutive frames.

A clip is a subfolder of `path` holding one image file per frame; frames play in name order, with
embedded numbers compared by value ("frame2" before "frame10"). Each training row is a window of
`frames` consecutive frames; windows start every `stride` frames. Batches hold "video" uint8
[T, H, W, C].
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dew.checks import count, count_fields
from dew.data.dataset import Batch, Dataset, Loading, Partition
from dew.data.images import (
    IMAGE_SUFFIXES,
    Rows,
    flip_coin,
    natural_key,
    read_image,
    split_records,
    train_stream,
    val_stream,
)


@dataclasses.dataclass(frozen=True)
class VideoFrames:
    """Windows of `frames` consecutive frames from every clip folder under `path`.

    A clip of L frames gives the windows starting at 0, stride, 2 * stride, ... that fit inside it;
    a clip shorter than `frames` is an error. `val_fraction` holds out whole clips (drawn from
    `seed`), so no validation frame appears in training. `flip=True` mirrors a whole training window
    when the coin keyed by (seed, window, epoch) says so.
    """

    path: str
    frames: int
    image_size: int
    stride: int = 1
    val_fraction: float = 0.0
    flip: bool = False
    seed: int = 0
    loading: Loading = Loading()

    def __post_init__(self):
        count_fields(self, image_size=1, frames=1, stride=1, seed=0)
        if not isinstance(self.loading, Loading):
            raise TypeError(f"VideoFrames.loading must be a Loading; got {self.loading!r}.")

    def clips(self) -> dict[str, list[str]]:
        """Each clip folder's name and its frame files (full paths, in play order)."""
        root = Path(self.path)
        if not root.is_dir():
            raise FileNotFoundError(
                f"VideoFrames reads a directory of clip folders; {str(root)!r} is not one."
            )
        clips = {}
        for folder in sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: natural_key(p.name)):
            if folder.name.startswith("."):
                continue
            names = [
                name for name in os.listdir(folder)
                if not name.startswith(".") and name.lower().endswith(IMAGE_SUFFIXES)
            ]
            clips[folder.name] = [str(folder / name) for name in sorted(names, key=natural_key)]
        if not clips or not any(clips.values()):
            raise ValueError(
                f"VideoFrames found no clips under {root}; expected one subfolder per clip holding "
                f"its frames as {', '.join(IMAGE_SUFFIXES)} files."
            )
        for name, frames in clips.items():
            if len(frames) < self.frames:
                raise ValueError(
                    f"Clip {root / name} has {len(frames)} frames, fewer than frames={self.frames}; "
                    "lower frames or remove the clip."
                )
        return clips

    def load(self, batch: int, tokenize=None) -> Dataset:
        """A Dataset of "video" (uint8 [frames, S, S, 3]) windows (`tokenize` is unused: no captions)."""
        batch = count(batch, "VideoFrames.load batch")
        clips = list(self.clips().values())
        train_clips, val_clips = split_records(len(clips), self.val_fraction, self.seed, "VideoFrames")
        train = self._windows([clips[i] for i in train_clips])
        val = self._windows([clips[i] for i in val_clips])
        size, flip, seed, loading = self.image_size, self.flip, self.seed, self.loading

        def train_factory(partition: Partition = Partition()) -> Iterator[Batch]:
            rows = _WindowRows(partition.rows(batch), train, size, flip, seed)
            return train_stream(len(train), batch, seed, rows, loading)

        def val_factory(partition: Partition = Partition()) -> Iterator[Batch]:
            return val_stream(
                range(len(val)), batch, partition, lambda rows: _WindowRows(rows, val, size, False, seed)
            )

        return Dataset(
            train=train_factory, val=val_factory if val else None, records=len(train), batch=batch
        )

    def _windows(self, clips: list[list[str]]) -> list[list[str]]:
        windows = []
        for frames in clips:
            for start in range(0, len(frames) - self.frames + 1, self.stride):
                windows.append(frames[start : start + self.frames])
        return windows


class _WindowRows(Rows):
    def __init__(self, rows, windows, size, flip, seed):
        super().__init__(rows)
        self.windows, self.size, self.flip, self.seed = windows, size, flip, seed

    def example(self, record: int, epoch: int) -> dict[str, Any]:
        video = np.stack([read_image(frame, self.size) for frame in self.windows[record]])
        if self.flip and flip_coin(self.seed, record, epoch):
            video = np.ascontiguousarray(video[:, :, ::-1])
        return {"video": video}
