"""Run configuration records (run.json)."""

from dew.config.run import ModelConfig, ObjectiveConfig, OptimConfig, RunConfig, TrainerConfig

__all__ = ["ModelConfig", "ObjectiveConfig", "OptimConfig", "RunConfig", "TrainerConfig"]
