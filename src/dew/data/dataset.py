"""Datasets: factories of batch iterators, and how Grain should load them.

A `Dataset` holds two factories. Each takes a `Partition` (which share of every global batch this
process reads) and returns a fresh iterator of batches: dicts of NumPy arrays whose axis 0 is this
process's rows of the global batch. Iterators with `get_state`/`set_state` (Grain's) let a checkpoint
record the data position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from dew import checks

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Partition:
    """This process's share of each global batch: rows `[index * rows, (index + 1) * rows)`."""

    index: int = 0
    count: int = 1

    def __post_init__(self):
        checks.count_fields(self, count=1, index=0)
        if not self.index < self.count:
            raise ValueError(f"Partition index must be in [0, {self.count}); got {self.index}.")

    def rows(self, global_batch: int) -> slice:
        """The slice of a global batch that this partition reads."""
        if global_batch % self.count:
            raise ValueError(
                f"The global batch of {global_batch} rows does not split over {self.count} processes; "
                f"use a batch that is a multiple of {self.count}."
            )
        share = global_batch // self.count
        return slice(self.index * share, (self.index + 1) * share)

    @classmethod
    def current(cls) -> Partition:
        """The partition of the running JAX process (one partition when single-process)."""
        import jax

        return cls(jax.process_index(), jax.process_count())


@dataclasses.dataclass(frozen=True)
class Loading:
    """How Grain reads: worker processes, read threads and the buffers between them.

    `workers=0` reads in the training process (no worker processes, no `__main__` guard needed).
    """

    workers: int = 0
    threads: int = 1
    read_buffer: int = 2
    worker_buffer: int = 2

    def __post_init__(self):
        checks.count_fields(self, workers=0, threads=1, read_buffer=0, worker_buffer=0)

    def apply(self, dataset):
        """Apply these settings to a Grain `MapDataset`, giving an `IterDataset`."""
        import grain

        iterable = dataset.to_iter_dataset(
            grain.ReadOptions(num_threads=self.threads, prefetch_buffer_size=self.read_buffer)
        )
        if self.workers > 0:
            from absl import flags

            if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags; a library never parses argv
                flags.FLAGS.mark_as_parsed()
            iterable = iterable.mp_prefetch(
                grain.MultiprocessingOptions(
                    num_workers=self.workers, per_worker_buffer_size=self.worker_buffer
                )
            )
        return iterable


Factory = Callable[[Partition], Iterator[Batch]]


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Training and validation iterator factories, with the dataset size and global batch."""

    train: Factory
    val: Factory | None = None
    records: int | None = None
    batch: int = 1

    def __post_init__(self):
        if not callable(self.train):
            raise TypeError(
                "Dataset.train must be a factory: a callable that takes a Partition and returns an "
                f"iterator of batches; got {type(self.train).__name__}."
            )
        if self.val is not None and not callable(self.val):
            raise TypeError(f"Dataset.val must be a factory or None; got {type(self.val).__name__}.")
        checks.count_fields(self, batch=1)

    @classmethod
    def from_records(
        cls,
        columns: Mapping[str, Any],
        *,
        batch: int,
        seed: int = 0,
        validation: Mapping[str, Any] | None = None,
        loading: Loading = Loading(),
    ) -> Dataset:
        """Batches of in-memory columns, reshuffled each epoch from `seed`.

        `columns` maps a name to an array whose axis 0 indexes records. Training batches repeat
        forever; `validation` (columns of the same form) is read once per pass, in order, with a
        short last batch kept.
        """
        batch = checks.count(batch, "Dataset.from_records batch")
        train_columns = _as_columns(columns, "columns")
        records = len(next(iter(train_columns.values())))

        def train(partition: Partition) -> Iterator[Batch]:
            import grain

            rows = partition.rows(batch)
            source = grain.MapDataset.range(records).shuffle(seed=seed).repeat().batch(batch, drop_remainder=True)
            source = source.map(lambda index: {k: v[index][rows] for k, v in train_columns.items()})
            return iter(loading.apply(source))

        val = None
        if validation is not None:
            val_columns = _as_columns(validation, "validation")
            val_records = len(next(iter(val_columns.values())))

            def val(partition: Partition) -> Iterator[Batch]:
                for start in range(0, val_records, batch):
                    chunk = {k: v[start : start + batch] for k, v in val_columns.items()}
                    size = len(next(iter(chunk.values())))
                    if size % partition.count:
                        break  # a ragged tail cannot be split evenly over processes
                    yield {k: v[partition.rows(size)] for k, v in chunk.items()}

        return cls(train=train, val=val, records=records, batch=batch)


def _as_columns(columns: Mapping[str, Any], what: str) -> dict[str, np.ndarray]:
    if not isinstance(columns, Mapping) or not columns:
        raise ValueError(f"{what} must be a non-empty mapping of name -> array; got {columns!r}.")
    arrays = {name: np.asarray(value) for name, value in columns.items()}
    lengths = {name: (a.shape[0] if a.ndim else None) for name, a in arrays.items()}
    if None in lengths.values() or len(set(lengths.values())) != 1:
        raise ValueError(
            f"Every column in {what} must have the same number of records on axis 0; got {lengths}."
        )
    if next(iter(lengths.values())) == 0:
        raise ValueError(f"{what} holds no records.")
    return arrays
