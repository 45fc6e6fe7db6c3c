"""Training: the Trainer, its state, checkpoints and device meshes."""

from dew.training.checkpoints import Checkpoints
from dew.training.mesh import Layout, MeshSpec
from dew.training.state import TrainState
from dew.training.trainer import Trainer

__all__ = ["Checkpoints", "Layout", "MeshSpec", "TrainState", "Trainer"]
