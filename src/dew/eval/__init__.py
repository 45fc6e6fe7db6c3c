"""Evaluation: scoring a validation pass with metrics (perplexity, FID, PSNR, SSIM, probes).

Names resolve on first use, so importing `dew.eval` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Evaluation": "dew.eval.evaluation",
    "EvaluationResult": "dew.eval.evaluation",
    "MeanOutputs": "dew.eval.evaluation",
    "Metric": "dew.eval.evaluation",
    "FID": "dew.eval.image_metrics",
    "FeatureMoments": "dew.eval.image_metrics",
    "InceptionFeatures": "dew.eval.image_metrics",
    "PSNR": "dew.eval.image_metrics",
    "RandomConvFeatures": "dew.eval.image_metrics",
    "SSIM": "dew.eval.image_metrics",
    "frechet_distance": "dew.eval.image_metrics",
    "image_grid": "dew.eval.image_metrics",
    "psnr": "dew.eval.image_metrics",
    "save_image_grid": "dew.eval.image_metrics",
    "ssim": "dew.eval.image_metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dew.eval' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
