"""Evaluation: scoring a validation pass with metrics (perplexity, FID, CLIPScore, PSNR, SSIM, probes), and
DewLM, a decoder behind lm-eval-harness.

Names resolve on first use, so importing `dew.eval` stays cheap.
"""

from __future__ import annotations

from dew._lazy import lazy_getattr

_EXPORTS = {
    "CLIPScore": "dew.eval.clip_score",
    "DewLM": "dew.eval.harness",
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
    "clip_pixels": "dew.eval.clip_score",
    "psnr": "dew.eval.image_metrics",
    "save_image_grid": "dew.eval.image_metrics",
    "ssim": "dew.eval.image_metrics",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
