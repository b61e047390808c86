"""What a run shows: W&B tracking, the console line, progress bars, FLOPs/MFU, held-out evaluation,
downstream tasks (lm-evaluation-harness, imported only when a run has tasks)."""

from lmpretrain.observe.console import ConsoleWarnings, StepLog, format_log_line
from lmpretrain.observe.evaluation import Evaluator, evaluate_all, generate_sample
from lmpretrain.observe.flops import MFUMeter
from lmpretrain.observe.metrics import StepMetrics
from lmpretrain.observe.profiler import StepProfiler
from lmpretrain.observe.step_bytes import StepBytes
from lmpretrain.observe.tasks import TaskSuite
from lmpretrain.observe.tracking import Tracker, wandb_log_with

__all__ = [
    "ConsoleWarnings",
    "Evaluator",
    "MFUMeter",
    "StepBytes",
    "StepLog",
    "StepMetrics",
    "StepProfiler",
    "TaskSuite",
    "Tracker",
    "evaluate_all",
    "format_log_line",
    "generate_sample",
    "wandb_log_with",
]
