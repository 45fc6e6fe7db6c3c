"""Built-in backbones. Names resolve on first use."""

from __future__ import annotations

from dew._lazy import lazy_getattr

_EXPORTS = {
    "JepaEncoder": "dew.nn.backbones.jepa",
    "JepaPredictor": "dew.nn.backbones.jepa",
    "CausalTransformer": "dew.nn.backbones.causal_transformer",
    "LayerKind": "dew.nn.backbones.layer_plan",
    "SimpleDiT": "dew.nn.backbones.dit",
    "UNet": "dew.nn.backbones.unet",
    "UNet2DCondition": "dew.nn.backbones.unet_condition",
    "MMDiT": "dew.nn.backbones.mmdit",
    "VideoDiT": "dew.nn.backbones.video_dit",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
