"""Checkpoints: the training state and the data position, saved asynchronously with Orbax, verified on read.

Each step is written under a temporary name and renamed when complete, so a step directory that
exists is whole; a crash mid-write leaves only a temporary directory, which is never restored. A
step holds three items: `state` (the TrainState's arrays), `data` (the iterator position as JSON)
and `digests` (a CRC-32 of every array and of the data item, see `dew.training.digests`). Every
read compares the digests, so a damaged step is reported by name instead of being trained on, and
a failed write is reported with the step it lost and the newest step that is complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno as errno_codes
import json
import logging
import os
import re
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

import jax

from dew import checks
from dew.training import digests, positions
from dew.training.state import TrainState

ITEMS = ("state", "data", "digests")
POSITION_ENCODING = "dew-json-1"


@dataclasses.dataclass(frozen=True)
class Damage:
    """What is wrong with one checkpoint step: which item (and array), what was expected and found."""

    step: int
    item: str
    array: str | None
    expected: str
    found: str

    def __str__(self) -> str:
        where = f"item {self.item!r}" + (f", array {self.array!r}" if self.array else "")
        return f"{where}: expected {self.expected}, found {self.found}"


class CheckpointCorrupted(ValueError):
    """A checkpoint step does not hold what was saved; names the damage and the intact steps."""

    def __init__(self, damage: Damage, directory: str | os.PathLike, intact_steps: tuple[int, ...] | list[int]):
        self.damage = damage
        self.step, self.item, self.array = damage.step, damage.item, damage.array
        self.expected, self.found = damage.expected, damage.found
        self.directory = str(directory)
        self.intact_steps = tuple(intact_steps)
        if self.intact_steps:
            newest = self.intact_steps[-1]
            advice = (
                f"Intact steps: {list(self.intact_steps)}. Load one by passing its step (e.g. "
                f"step={newest}: dew.pipeline(..., step={newest}), `dew export --step {newest}`); "
                "Trainer.fit resumes from the newest intact step by itself."
            )
        else:
            advice = "No intact step remains in this directory; move it aside to start the run afresh."
        super().__init__(f"Checkpoint step {damage.step} in {self.directory} is damaged: {damage}. {advice}")


class CheckpointSaveFailed(RuntimeError):
    """Writing a checkpoint step failed; names the step, the directory, the cause and the newest complete step."""

    def __init__(self, step: int, directory: str | os.PathLike, cause: str, newest_complete: int | None):
        self.step, self.directory, self.cause, self.newest_complete = step, str(directory), cause, newest_complete
        kept = (
            f"The newest complete step is {newest_complete}; a run started again resumes from it."
            if newest_complete is not None
            else "No step in this directory is complete; a run started again starts from the beginning."
        )
        super().__init__(
            f"Could not write checkpoint step {step} to {self.directory}: {cause}. Its partial files "
            f"were removed. {kept} Free space or fix the directory (or choose another with "
            "Checkpoints(directory)) and run again."
        )


class PickledDataPosition(ValueError):
    """A step written by an older Dew keeps its data position as a pickle, which is never loaded."""


class Checkpoints:
    """A directory of checkpoint steps, keeping the newest `keep` (None keeps all).

    `restore_position=False` restores the training state but not the data position (the data
    iterator starts from its beginning); use it to resume from a step whose position cannot be read.
    """

    def __init__(self, directory: str | os.PathLike, keep: int | None = 2, *, restore_position: bool = True):
        self.directory = Path(directory).absolute()
        self.keep = checks.count(keep, "Checkpoints keep", optional=True)
        self.restore_position = bool(restore_position)
        self._manager = None
        self._writing: int | None = None  # the step whose write may still be in flight

    def __repr__(self) -> str:
        return f"Checkpoints({str(self.directory)!r}, keep={self.keep})"

    @property
    def manager(self):
        if self._manager is None:
            import orbax.checkpoint as ocp

            _quiet_orbax_errors()
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.keep, create=True, enable_async_checkpointing=True
            )
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        return self._manager

    def steps(self) -> list[int]:
        """The complete steps on disk, oldest first."""
        if not self.directory.exists():
            return []
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    # ----------------------------------------------------------------------------------------
    # Writing.

    def save(self, state: TrainState, data_position: Any = None) -> None:
        """Start writing `state` at its step; returns once the arrays are copied to the host.

        The host copies are what Orbax writes and what the digests are computed from, on Orbax's
        background thread. A failed write raises CheckpointSaveFailed here or at the next `save`
        or `wait`.
        """
        import orbax.checkpoint as ocp

        step = int(state.step)
        data = {"encoding": POSITION_ENCODING, "position": positions.encode(data_position)}
        self.wait()  # a failure of the previous step is reported as that step's
        storable = _to_storable(state)
        arrays = None
        if all(_addressable(leaf) for leaf in jax.tree_util.tree_leaves(storable)):
            storable = jax.device_get(storable)  # the one copy off the device, as Orbax would make
            arrays = digests.named_arrays(storable)
        from dew.training.digest_item import DigestsSave

        self._writing = step
        with self._reporting_save_failures():
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(storable),
                    data=ocp.args.JsonSave(data),
                    digests=DigestsSave(arrays, data),
                ),
            )

    def wait(self) -> None:
        """Block until every started write is on disk; raises CheckpointSaveFailed if one failed."""
        if self._manager is not None:
            with self._reporting_save_failures():
                self._manager.wait_until_finished()
        self._writing = None

    def close(self) -> None:
        if self._manager is not None:
            self.wait()
            self._manager.close()
            self._manager = None

    @contextlib.contextmanager
    def _reporting_save_failures(self):
        try:
            yield
        except Exception as error:
            step = self._writing
            if step is None:
                raise
            self._writing = None
            self._abandon_manager()
            for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointSaveFailed(step, self.directory, _cause(error), self.latest()) from None

    def _abandon_manager(self) -> None:
        """Drop a manager whose write failed; closing it would only raise the same failure again."""
        manager, self._manager = self._manager, None
        if manager is not None:
            with contextlib.suppress(Exception):
                manager.close()

    # ----------------------------------------------------------------------------------------
    # Reading.

    def restore(self, abstract: TrainState, step: int | None = None) -> tuple[TrainState, Any]:
        """Read a step (the latest by default) into the shapes and shardings of `abstract`.

        Raises CheckpointCorrupted when the step does not match its digests or cannot be read.
        """
        step = self._chosen(step)
        target = _to_storable(abstract)
        tree, data = self._read(step, target)
        tree = jax.tree_util.tree_map(  # a target without a sharding: the default device
            lambda value, leaf: jax.device_put(value, getattr(leaf, "sharding", None)), tree, target
        )
        position = self._position(step, data) if self.restore_position else None
        return _from_storable(tree), position

    def restore_variables(self, step: int | None = None) -> tuple[dict[str, Any], Any, int]:
        """Only the weights of a step (latest by default): `(variables, ema or None, step)`.

        Needs no optimizer or model: the arrays are read as they were saved (as NumPy arrays), and
        checked against the step's digests like `restore`.
        """
        step = self._chosen(step)
        tree, _ = self._read(step, None)
        return tree["variables"], tree.get("ema"), step

    def verify(self, step: int | None = None) -> dict[int, Damage | None]:
        """Check one step (or every step) against its digests: `{step: Damage or None if intact}`.

        A step written before Dew recorded digests is read in full and counts as intact if it reads.
        """
        steps = self.steps() if step is None else [self._chosen(step)]
        return {s: self._damage(s) for s in steps}

    def set_aside(self, step: int) -> Path:
        """Rename a (damaged) step to `<step>.damaged`, out of the steps a run reads or overwrites.

        Nothing is deleted: the files stay for inspection under the new name.
        """
        source = self.directory / str(self._chosen(step))
        destination = source.with_name(f"{step}.damaged")
        suffix = 1
        while destination.exists():
            suffix += 1
            destination = source.with_name(f"{step}.damaged-{suffix}")
        source.rename(destination)
        if self._manager is not None:
            self._manager.reload()
        return destination

    def digested(self, step: int) -> bool:
        """Whether `step` was written with digests (every step Dew writes now is)."""
        return _digested(self.directory / str(step))

    def _chosen(self, step: int | None) -> int:
        steps = self.steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"No complete checkpoint in {self.directory}.")
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(
                f"No complete checkpoint step {step} in {self.directory}; the complete steps are {steps}."
            )
        return step

    def _damage(self, step: int) -> Damage | None:
        try:
            self._read(step, None, report=False)
        except _Damaged as damaged:
            return damaged.damage
        return None

    def _read(self, step: int, target: Any, report: bool = True) -> tuple[Any, dict[str, Any]]:
        """The state tree (NumPy arrays, or arrays in `target`'s shardings for a step without
        digests) and the data item of `step`, checked against its digests.

        Raises CheckpointCorrupted naming the intact steps (`_Damaged` when `report` is False).
        """
        try:
            return self._read_checked(step, target)
        except _Damaged as damaged:
            if not report:
                raise
            intact = [s for s in self.steps() if s != step and self._damage(s) is None]
            raise CheckpointCorrupted(damaged.damage, self.directory, intact) from None

    def _read_checked(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        import orbax.checkpoint as ocp

        from dew.training.digest_item import DigestsRestore

        directory = self.directory / str(step)
        digested = _digested(directory)
        for item in ITEMS if digested else ITEMS[:2]:
            if not (directory / item).is_dir():
                raise _Damaged(Damage(step, item, None, "the item's directory", "it is missing"))
        record = None
        if digested:
            record = self._item(step, "digests", DigestsRestore(), "a readable digest record")
        data = self._item(step, "data", ocp.args.JsonRestore(), "a readable JSON data position")
        if record is not None:
            found = digests.json_digest(data)
            if found != record["data"]:
                raise _Damaged(Damage(step, "data", "position", record["data"], found))
        if record is None or record["arrays"] is None:
            # Written without array digests (by an older Dew, or by a multi-process run): Orbax
            # reads it straight into the target's shardings; a read error is still damage.
            return self._state(step, target), data
        tree = self._state(step, _host_target(target))
        self._compare(step, tree, record["arrays"])
        return tree, data

    def _item(self, step: int, name: str, args: Any, expected: str) -> Any:
        """One small item of a step (the digests or the data position); unreadable is damage."""
        import orbax.checkpoint as ocp

        try:
            return self.manager.restore(step, args=ocp.args.Composite(**{name: args}))[name]
        except Exception as error:
            raise _Damaged(Damage(step, name, None, expected, f"unreadable ({_cause(error)})")) from None

    def _state(self, step: int, target: Any) -> Any:
        """The state item read into `target` (None: as saved). A read error is damage, unless the
        step reads as saved and only the target does not match it (another model or optimizer)."""
        import orbax.checkpoint as ocp

        def read(into):
            return self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(into)))["state"]

        try:
            return read(target)
        except Exception as error:
            if target is not None:
                try:
                    read(None)
                except Exception:
                    pass
                else:
                    raise
            found = f"unreadable ({_cause(error)})"
            raise _Damaged(Damage(step, "state", _array_in(error), "readable arrays", found)) from None

    def _compare(self, step: int, tree: Any, recorded: dict[str, str]) -> None:
        read = dict(digests.named_arrays(tree))
        for name, expected in recorded.items():
            if name not in read:
                raise _Damaged(Damage(step, "state", name, expected, "no such array in the item"))
            found = digests.array_digest(read[name])
            if found != expected:
                raise _Damaged(Damage(step, "state", name, expected, found))
        for name in read.keys() - recorded.keys():
            raise _Damaged(Damage(step, "digests", name, "a digest for every array", "none recorded"))

    def _position(self, step: int, data: dict[str, Any]) -> Any:
        if data.get("encoding") == POSITION_ENCODING:
            return positions.decode(data["position"])
        position = data.get("position")  # the form older Dew wrote: {"json": ...} or {"pickle": ...}
        if position is None:
            return None
        if isinstance(position, dict) and "json" in position:
            return position["json"]
        raise PickledDataPosition(
            f"Checkpoint step {step} in {self.directory} keeps its data position as a pickle, which "
            "Dew does not load (unpickling runs code from the file). To resume from this step's "
            "weights and optimizer state with the data read from its beginning, pass "
            f"Checkpoints({str(self.directory)!r}, restore_position=False)."
        )


class _Damaged(Exception):
    def __init__(self, damage: Damage):
        super().__init__(str(damage))
        self.damage = damage


def _digested(directory: Path) -> bool:
    """A step records digests if its digests item exists or its Orbax metadata names that item."""
    if (directory / "digests").is_dir():
        return True
    try:
        handlers = json.loads((directory / "_CHECKPOINT_METADATA").read_text()).get("item_handlers") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return "digests" in handlers


def _addressable(leaf: Any) -> bool:
    return not isinstance(leaf, jax.Array) or leaf.is_fully_addressable


def _host_target(target: Any) -> Any:
    """`target` with every array as a shape and dtype alone, so Orbax reads NumPy arrays."""
    if target is None:
        return None
    return jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), target)


_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'")
_READING = re.compile(r'Error reading "([^"/]+)/')


def _cause(error: BaseException) -> str:
    """The root of a failure in a line: the OS error when there is one, else the first line."""
    seen, link = set(), error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        code = link.errno if isinstance(link, OSError) and link.errno else None
        match = _OS_ERROR_CODE.search(str(link))
        if code is None and match:
            code = int(match.group(1))
        if code:
            return f"{os.strerror(code)} ({errno_codes.errorcode.get(code, code)})"
        link = link.__cause__ or link.__context__
    return _first_line(str(error))


def _first_line(text: str) -> str:
    text = text.split(" [tensorstore_spec=")[0].strip().splitlines()
    return (text[0] if text else "no message")[:300]


def _array_in(error: BaseException) -> str | None:
    """The array a tensorstore read error names (`variables.params.kernel` -> `variables/params/kernel`)."""
    match = _READING.search(str(error))
    return match.group(1).replace(".", "/") if match else None


class _OrbaxErrors(logging.Filter):
    """Drop the error logs (and their tracebacks) a failed Orbax write leaves behind.

    Orbax logs each failing thread through absl, and asyncio logs the failures of the sibling
    writes Orbax never collected (they name its temporary step directory). Checkpoints raises each
    failure itself, once, with the step and the cause, so these only bury that message.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if f"{os.sep}orbax{os.sep}" in record.pathname:
            return False
        details = record.getMessage() + (str(record.exc_info[1]) if record.exc_info else "")
        return ".orbax-checkpoint-tmp" not in details


def _quiet_orbax_errors() -> None:
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OrbaxErrors) for f in logger.filters):
            logger.addFilter(_OrbaxErrors())
    _quiet_late_write_callbacks()


def _quiet_late_write_callbacks() -> None:
    """Drop the 'Event loop is closed' reports that the sibling writes of a failed write leave.

    Orbax runs a step's tensorstore writes on an event loop that it closes at the first failure;
    the writes still in flight then complete into the closed loop, and Python prints each as an
    unraisable RuntimeError from asyncio's `call_soon_threadsafe`. Every other unraisable
    exception is passed on to the hook that was there before.
    """
    previous = sys.unraisablehook
    if getattr(previous, "_dew_late_write_callbacks", False):
        return

    def hook(unraisable) -> None:
        frames = traceback.extract_tb(unraisable.exc_traceback) if unraisable.exc_traceback else []
        late = (
            unraisable.exc_type is RuntimeError
            and str(unraisable.exc_value) == "Event loop is closed"
            and any(frame.name == "call_soon_threadsafe" for frame in frames)
        )
        if not late:
            previous(unraisable)

    hook._dew_late_write_callbacks = True
    sys.unraisablehook = hook


def _to_storable(state: TrainState) -> dict[str, Any]:
    """A plain dict tree Orbax can write: typed PRNG keys become their raw uint32 data."""
    key = state.key
    if isinstance(key, jax.ShapeDtypeStruct):
        key_data = jax.eval_shape(jax.random.key_data, key)
        if getattr(key, "sharding", None) is not None:
            key_data = jax.ShapeDtypeStruct(key_data.shape, key_data.dtype, sharding=key.sharding)
    else:
        key_data = jax.random.key_data(key)
    return {
        "step": state.step,
        "updates": state.updates,
        "variables": state.variables,
        "opt_state": state.opt_state,
        "ema": state.ema,
        "key": key_data,
    }


def _from_storable(tree: dict[str, Any]) -> TrainState:
    return TrainState(
        step=tree["step"],
        updates=tree["updates"],
        variables=tree["variables"],
        opt_state=tree["opt_state"],
        ema=tree["ema"],
        key=jax.random.wrap_key_data(tree["key"]),
    )
