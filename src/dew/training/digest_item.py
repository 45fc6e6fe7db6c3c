"""The `digests` item of a checkpoint step: Orbax writes it beside `state` and `data`.

`Checkpoints.save` hands Orbax host copies of the arrays and hands the same copies to this item,
which hashes them on Orbax's background thread (zlib releases the GIL, so the training thread
keeps running) and writes `digests/digests.json`. Orbax commits a step (renames it into place) only
after every item is written, so a step on disk always carries the digests of exactly the bytes that
were saved. Imported on first use, like Orbax itself.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp

from dew.training.digests import check_record, record

FILENAME = "digests.json"


class DigestsHandler(ocp.AsyncCheckpointHandler):
    """The Orbax handler of the `digests` item: hashes on the background thread, then writes JSON."""

    async def async_save(self, directory, args: DigestsSave) -> list[ocp.future.Future]:
        async def write() -> None:
            self.save(directory, args)

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="dew_digests")]

    def save(self, directory, args: DigestsSave) -> None:
        if jax.process_index() == 0:
            text = json.dumps(record(args.arrays, args.data), indent=1, sort_keys=True)
            (directory / FILENAME).write_text(text)

    def restore(self, directory, args: DigestsRestore | None = None) -> dict[str, Any]:
        return check_record(json.loads((directory / FILENAME).read_text()))


@ocp.args.register_with_handler(DigestsHandler, for_save=True)
@dataclasses.dataclass
class DigestsSave(ocp.args.CheckpointArgs):
    """The host copies of a step's arrays (None when they were not copied) and its data item."""

    arrays: Sequence[tuple[str, Any]] | None
    data: Any


@ocp.args.register_with_handler(DigestsHandler, for_restore=True)
@dataclasses.dataclass
class DigestsRestore(ocp.args.CheckpointArgs):
    """Read a step's digest record."""
