"""Atomic writes: a file or a directory appears whole under its name, or not at all.

Every writer in Dew that leaves something a later run reads (run.json, exports, journals, images)
goes through these, so a crash or a full disk never leaves a half-written file behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: str | bytes, *, encoding: str = "utf-8") -> Path:
    """Write `data` to a temporary sibling of `path`, flush it to disk, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data.encode(encoding) if isinstance(data, str) else data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return path


@contextlib.contextmanager
def staged_directory(dest: str | os.PathLike, *, overwrite: bool = True) -> Iterator[Path]:
    """Yield an empty hidden sibling of `dest` to fill; on success it replaces `dest` whole.

    On an exception the staging directory is removed and `dest` is left as it was. A non-empty
    `dest` is replaced only with ``overwrite=True``; the old contents are removed only after the
    new directory is in place.
    """
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise FileExistsError(f"{dest} exists and is not a directory; choose another destination.")
    if not overwrite and dest.is_dir() and any(dest.iterdir()):
        raise FileExistsError(f"{dest} is not empty; pass overwrite=True to replace it or choose an empty directory.")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
    try:
        yield staging
        replace_directory(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def replace_directory(staging: Path, dest: Path) -> None:
    """Rename the finished `staging` directory to `dest`, putting the old `dest` back on failure."""
    if not dest.exists():
        staging.rename(dest)
        return
    if not any(dest.iterdir()):
        dest.rmdir()
        staging.rename(dest)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".old", dir=dest.parent))
    old.rmdir()
    dest.rename(old)
    try:
        staging.rename(dest)
    except BaseException:
        old.rename(dest)
        raise
    shutil.rmtree(old, ignore_errors=True)
