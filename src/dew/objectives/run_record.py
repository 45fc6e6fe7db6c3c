"""The run.json writer as the objectives see it: declared here, installed by `dew.config`.

A run description in objective terms (`dew.objectives.diffusion.DiffusionRunConfig`) saves the
same run.json that `RunConfig.save` writes, so `dew.pipeline` and `TextToImage.from_run` read it
like any run. `dew.config` sits above the objectives in the layers, so they cannot import it;
instead `dew.config.run` installs its writer here when it is imported. A run description holds
dew.config's `ModelConfig` and `TrainerConfig`, so the writer is installed whenever one exists.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

_writer: Callable[..., Path] | None = None


def install(writer: Callable[..., Path]) -> None:
    """Set the function that writes run.json: ``writer(directory, *, model, data, optim, trainer,
    objective_class, objective_settings, sampling) -> path``."""
    global _writer
    _writer = writer


def write(directory: Any, **parts: Any) -> Path:
    """Write run.json into `directory` with the installed writer."""
    if _writer is None:
        raise RuntimeError(
            "No run.json writer is installed: dew.config installs it when it is imported. Build the "
            "run description's model and trainer settings with dew.config (ModelConfig.from_model, "
            "TrainerConfig), which imports it."
        )
    return _writer(directory, **parts)
