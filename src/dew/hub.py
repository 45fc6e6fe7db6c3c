"""Local directories and Hugging Face Hub repositories, named the same way everywhere.

`local_directory(source, revision=None)` turns what a user passes to `dew.pipeline`,
`PretrainedDecoder.load`, `HFTokenizer` or `dew tokenize` into a directory on disk: an existing
directory is used as it is, and a repository id (``"Qwen/Qwen3-0.6B"``) is resolved through
`huggingface_hub`, which reads its cache first and honours ``HF_HUB_OFFLINE``, ``HF_HUB_CACHE``
and ``revision`` (a branch, a tag or a commit hash).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

# owner/name, each part letters, digits, '-', '_' and '.' (the Hub's own rule for repo ids)
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_repo_id(source: object) -> bool:
    """Whether `source` has the shape of a Hub repository id (``owner/name``)."""
    return isinstance(source, str) and bool(_REPO_ID.match(source)) and ".." not in source


def local_directory(
    source: str | os.PathLike,
    *,
    revision: str | None = None,
    allow_patterns: Sequence[str] | None = None,
    what: str = "checkpoint",
) -> Path:
    """The directory `source` names: a local directory, or a Hub repository's snapshot.

    A local directory wins over a repository id of the same spelling. `revision` applies to
    repositories only. With ``HF_HUB_OFFLINE=1`` only the cache is read. Raises FileNotFoundError
    naming what was tried when neither resolves.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} pins a Hub repository, but {str(source)!r} is a local directory.")
        return path
    if not is_repo_id(str(source)):
        raise FileNotFoundError(
            f"{str(source)!r} is not a local directory, and not a Hub repository id (owner/name), "
            f"so no {what} could be found there."
        )
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return Path(snapshot_download(str(source), revision=revision,
                                      allow_patterns=list(allow_patterns) if allow_patterns else None))
    except (LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError, HfHubHTTPError, OSError) as error:
        offline = " (HF_HUB_OFFLINE is set, so only the cache was read)" if constants.HF_HUB_OFFLINE else ""
        pinned = f" at revision {revision!r}" if revision is not None else ""
        raise FileNotFoundError(
            f"{str(source)!r} is not a local directory, and the Hub repository {str(source)!r}{pinned} "
            f"could not be read from the cache at {constants.HF_HUB_CACHE}{offline}: "
            f"{type(error).__name__}: {str(error).splitlines()[0].rstrip('.') if str(error) else ''}. Download it "
            f"first (`hf download {source}`) or pass a local {what} directory."
        ) from None
