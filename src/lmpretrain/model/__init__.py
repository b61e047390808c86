"""The model and what it computes: building it, μP by width, the objective and its loss kernels, a mixture of
experts' routing, speed switches, mixed precision."""

from lmpretrain.model import mup
from lmpretrain.model.build import (
    build_model,
    build_model_config,
    import_model_modules,
    parameter_counts,
    refuse_unfound_embedding,
)
from lmpretrain.model.fp8 import precompute_fp8_scales
from lmpretrain.model.loss import IGNORE_INDEX, LossSums, count_targets, logits_loss_sums, make_labels
from lmpretrain.model.meta_init import ModelInit
from lmpretrain.model.objective import Forward, LMObjective, Term, weighted_sum
from lmpretrain.model.precision import MixedPrecision
from lmpretrain.model.routing import ExpertLoad
from lmpretrain.model.sharded_precision import check_sharded_precision
from lmpretrain.model.speed import compile_seconds, prepare_model

__all__ = [
    "IGNORE_INDEX",
    "ExpertLoad",
    "Forward",
    "LMObjective",
    "LossSums",
    "MixedPrecision",
    "ModelInit",
    "Term",
    "build_model",
    "build_model_config",
    "check_sharded_precision",
    "compile_seconds",
    "count_targets",
    "import_model_modules",
    "logits_loss_sums",
    "make_labels",
    "mup",
    "parameter_counts",
    "precompute_fp8_scales",
    "prepare_model",
    "refuse_unfound_embedding",
    "weighted_sum",
]
