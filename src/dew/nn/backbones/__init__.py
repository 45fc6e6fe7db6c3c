"""Built-in backbones. Names resolve on first use."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "JepaEncoder": "dew.nn.backbones.jepa",
    "JepaPredictor": "dew.nn.backbones.jepa",
    "CausalTransformer": "dew.nn.backbones.causal_transformer",
    "LayerKind": "dew.nn.backbones.layer_plan",
    "SimpleDiT": "dew.nn.backbones.dit",
    "UNet": "dew.nn.backbones.unet",
    "MMDiT": "dew.nn.backbones.mmdit",
    "VideoDiT": "dew.nn.backbones.video_dit",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dew.nn.backbones' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
