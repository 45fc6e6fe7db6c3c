"""Preference pairs for DPO: a chosen and a rejected token row per prompt, with response masks.

A record holds "chosen" and "rejected" (token ids, prompt included) and "chosen_mask" and
"rejected_mask" (1 on the response tokens the loss scores, 0 on the prompt). Records are dicts or
JSON strings, or lines of a JSONL file. Each row is padded with `pad_id` (mask 0) to `seq_len`, the
width of the whole id row; `DPOObjective(seq_len=...)` takes one less, for the next-token shift.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from dew.checks import count
from dew.data.chat_messages import read_records
from dew.data.dataset import Dataset, Loading

_FIELDS = ("chosen", "rejected", "chosen_mask", "rejected_mask")


class PreferencePairs:
    """Chosen/rejected pairs as "chosen", "rejected", "chosen_mask", "rejected_mask" `[seq_len]`."""

    def __init__(
        self,
        records: Any = None,
        seq_len: int | None = None,
        *,
        path: str | os.PathLike | None = None,
        loading: Loading = Loading(),
        seed: int = 0,
        pad_id: int = 0,
    ):
        if isinstance(records, (str, os.PathLike)) and path is None:
            records, path = None, records
        if (records is None) == (path is None):
            raise ValueError("PreferencePairs takes exactly one of records= (dicts or JSON strings) or path=.")
        seq_len = count(seq_len, "PreferencePairs seq_len (the width of a whole id row)", minimum=2)
        self.records = records
        self.path = path
        self.seq_len = seq_len
        self.loading = loading
        self.seed = seed
        self.pad_id = int(pad_id)
        self._columns: dict[str, np.ndarray] | None = None

    def columns(self) -> dict[str, np.ndarray]:
        if self._columns is None:
            records = read_records(self.path if self.path is not None else self.records, "records")
            if not records:
                raise ValueError("PreferencePairs has no records.")
            columns = {name: np.zeros((len(records), self.seq_len), np.int32) for name in _FIELDS}
            columns["chosen"][:] = self.pad_id
            columns["rejected"][:] = self.pad_id
            for index, record in enumerate(records):
                for side in ("chosen", "rejected"):
                    ids, mask = self._side(record, index, side)
                    columns[side][index, : len(ids)] = ids
                    columns[f"{side}_mask"][index, : len(mask)] = mask
            self._columns = columns
        return self._columns

    def _side(self, record, index, side):
        missing = [name for name in (side, f"{side}_mask") if name not in record]
        if missing:
            raise ValueError(
                f"preference record {index} has no {missing}; each record needs {list(_FIELDS)} "
                f"(it has {sorted(record)})."
            )
        ids = np.asarray(record[side])
        mask = np.asarray(record[f"{side}_mask"])
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"preference record {index}: {side!r} must be a flat list of token ids.")
        if mask.shape != ids.shape:
            raise ValueError(
                f"preference record {index}: {side}_mask has {mask.size} entries but {side} has "
                f"{ids.size} ids; the mask marks each id (1 on the response)."
            )
        if ids.size > self.seq_len:
            raise ValueError(
                f"preference record {index}: {side!r} has {ids.size} ids, more than seq_len="
                f"{self.seq_len}. Raise seq_len or shorten the record."
            )
        if not mask.any():
            raise ValueError(f"preference record {index}: {side}_mask marks no response tokens.")
        return ids.astype(np.int32), (mask != 0).astype(np.int32)

    def load(self, batch: int) -> Dataset:
        """Shuffled batches that repeat forever (a Grain iterator with get_state/set_state)."""
        return Dataset.from_records(self.columns(), batch=batch, seed=self.seed, loading=self.loading)

    def __len__(self) -> int:
        return len(self.columns()["chosen"])
