"""Hugging Face checkpoints in and out of Dew: `Pretrained.load` / `PretrainedDecoder` and save."""

from dew.interop.adapted import AdaptedDecoder
from dew.interop.decoder import Pretrained, PretrainedDecoder
from dew.interop.families import DECODER_FAMILIES, supported_model_types

__all__ = ["AdaptedDecoder", "Pretrained", "PretrainedDecoder", "DECODER_FAMILIES", "supported_model_types"]
