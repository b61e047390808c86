"""How weights change: the optimizer, the learning-rate schedule, the guard that skips bad updates, the
weights' moving average (EMA)."""

from lmpretrain.update.ema import WeightAverage
from lmpretrain.update.guard import UpdateGuard
from lmpretrain.update.muon import muon_problems
from lmpretrain.update.optim import (
    apply_hyperparameters,
    build_optimizer,
    describe_groups,
    describe_implementation,
)
from lmpretrain.update.rollback import SpikeRollback
from lmpretrain.update.schedule import hyperparameter_changes, learning_rate, set_lr

__all__ = [
    "SpikeRollback",
    "UpdateGuard",
    "WeightAverage",
    "apply_hyperparameters",
    "build_optimizer",
    "describe_groups",
    "describe_implementation",
    "hyperparameter_changes",
    "learning_rate",
    "muon_problems",
    "set_lr",
]
