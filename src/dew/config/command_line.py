"""Recipe command lines: every field of a frozen dataclass a flag (tyro), starting from a file.

`parse(Recipe)` reads `--config FILE` first (JSON, or TOML for a `.toml` file; nested tables for
nested settings, any subset of them), applies it over the dataclass's defaults, then lets every
other flag override that, so `--config runs/lm/recipe.json --optim.learning-rate 3e-4` reruns a
recorded recipe with one change. `save_recipe` writes the resolved settings a run started from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from dew.config.overrides import apply_overrides
from dew.files import write_atomic

Config = TypeVar("Config")

CONFIG_FLAG = "--config"
RECIPE_FILE = "recipe.json"


def parse(cls: type[Config], args: Sequence[str] | None = None, *, description: str | None = None) -> Config:
    """The recipe settings from the command line (`sys.argv[1:]` by default)."""
    import tyro

    args = list(sys.argv[1:] if args is None else args)
    file, rest = _split_config_flag(args)
    start = cls() if file is None else read_config_file(cls, file)
    about = (description or cls.__doc__ or "").strip()
    about += (f"\n\n{CONFIG_FLAG} FILE starts from the settings in FILE (JSON or TOML, nested like the "
              f"flags; a run's {RECIPE_FILE} reruns it); the flags given override them.")
    return tyro.cli(cls, args=rest, default=start, description=about)


def read_config_file(cls: type[Config], path: str | os.PathLike) -> Config:
    """`cls()` with the settings of the JSON or TOML file at `path` applied (names and types checked)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{CONFIG_FLAG} names {str(path)!r}, which is not a file.")
    text = path.read_text(encoding="utf-8")
    try:
        settings = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"{path} is not valid {'TOML' if path.suffix == '.toml' else 'JSON'}: {error}") from error
    if not isinstance(settings, Mapping):
        raise ValueError(f"{path} holds {type(settings).__name__}; a config file holds one object of settings.")
    try:
        return apply_overrides(cls(), dict(_flatten(settings)))
    except (ValueError, TypeError) as error:
        raise type(error)(f"{path}: {error}") from error


def save_recipe(config: Any, directory: str | os.PathLike) -> Path:
    """Write the resolved recipe settings to `directory/recipe.json` (atomically)."""
    return write_atomic(Path(directory) / RECIPE_FILE, json.dumps(dataclasses.asdict(config), indent=2) + "\n")


def _split_config_flag(args: list[str]) -> tuple[str | None, list[str]]:
    file, rest = None, []
    items = iter(args)
    for arg in items:
        if arg == CONFIG_FLAG:
            file = next(items, None)
            if file is None:
                raise SystemExit(f"{CONFIG_FLAG} needs a file name.")
        elif arg.startswith(CONFIG_FLAG + "="):
            file = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return file, rest


def _flatten(settings: Mapping[str, Any], prefix: str = ""):
    """(dotted path, value) pairs; lists become tuples, as the dataclasses hold them."""
    for name, value in settings.items():
        path = f"{prefix}{name.replace('-', '_')}"  # flag spelling (learning-rate) or field name
        if isinstance(value, Mapping):
            yield from _flatten(value, path + ".")
        else:
            yield path, tuple(value) if isinstance(value, list) else value
