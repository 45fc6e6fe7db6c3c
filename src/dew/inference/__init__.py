"""Inference: tasks that pair a model with its weights, and `pipeline`, which builds one from a source.

Names resolve on first use: the task modules sit below the objectives that build them, and
`pipeline` (which reads runs, checkpoints and the Hub) sits above everything else.
"""

from __future__ import annotations

from dew._lazy import lazy_getattr

_EXPORTS = {
    "TextGeneration": "dew.inference.text",
    "TextToImage": "dew.inference.image",
    "Images": "dew.inference.image",
    "MaskedGeneration": "dew.inference.masked",
    "RunProcessor": "dew.inference.processor",
    "pipeline": "dew.inference.pipeline",
    "Server": "dew.inference.serving",
    "TokenEvent": "dew.inference.serving",
    "Completion": "dew.inference.clients",
    "OpenAICompletion": "dew.inference.clients",
    "OllamaCompletion": "dew.inference.clients",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())

# TextToImage.from_run reads saved runs, which only the top of the stack can do: the task modules sit
# below the objectives that build them. dew.pipeline installs its run reader into the task module when
# it is imported, and every task is imported through this package, so the reader is always there.
from dew.inference.pipeline import pipeline  # noqa: E402
