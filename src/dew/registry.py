"""Short names for the built-in models, for command lines and records.

`models` maps an alias to the model class's import path; `resolve_model(name)` accepts either.
"""

from __future__ import annotations

from typing import Any

models: dict[str, str] = {
    "causal_transformer": "dew.nn.backbones.causal_transformer.CausalTransformer",
    "simple_dit": "dew.nn.backbones.dit.SimpleDiT",
    "unet": "dew.nn.backbones.unet.UNet",
    "mmdit": "dew.nn.backbones.mmdit.MMDiT",
    "video_dit": "dew.nn.backbones.video_dit.VideoDiT",
    "jepa_encoder": "dew.nn.backbones.jepa.JepaEncoder",
    "jepa_predictor": "dew.nn.backbones.jepa.JepaPredictor",
}


def resolve_model(name: str) -> Any:
    """The model class for an alias (`simple_dit`) or an import path."""
    from dew.config.records import resolve

    if name in models:
        return resolve(models[name])
    if "." in name:
        return resolve(name)
    raise ValueError(f"Unknown model {name!r}; aliases are {sorted(models)}, or pass an import path.")
