"""Inference tasks: immutable pairs of a model and its weights."""

from dew.inference.text import TextGeneration

__all__ = ["TextGeneration"]
