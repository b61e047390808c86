"""The model and what it computes: building it, the objective and its loss kernels, speed switches,
mixed precision."""

from lmpretrain.model.build import build_model, build_model_config, parameter_counts
from lmpretrain.model.loss import count_targets, make_labels
from lmpretrain.model.objective import LMObjective
from lmpretrain.model.precision import MixedPrecision
from lmpretrain.model.sharded_precision import check_sharded_precision
from lmpretrain.model.speed import compile_seconds, prepare_model

__all__ = [
    "LMObjective",
    "MixedPrecision",
    "build_model",
    "build_model_config",
    "check_sharded_precision",
    "compile_seconds",
    "count_targets",
    "make_labels",
    "parameter_counts",
    "prepare_model",
]
