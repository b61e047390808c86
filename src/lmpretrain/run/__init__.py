"""Processes and the run around the loop: accelerate set-up, ranks, signals, the run lock, RNG, step
counters, the step's one device read (redone at half the micro-batch when out of memory), the resume
fingerprint."""

from lmpretrain.run import expert_parallel, runtime
from lmpretrain.run.distributed import check_replicas_identical
from lmpretrain.run.downloads import local_main_first, on_rank_zero
from lmpretrain.run.fingerprint import check_fingerprint, run_fingerprint
from lmpretrain.run.oom_retry import halve_on_oom
from lmpretrain.run.preemption import PreemptionHandler
from lmpretrain.run.provenance import provenance
from lmpretrain.run.resume import check_resume, resumed
from lmpretrain.run.rng import LoopRNG
from lmpretrain.run.runlock import run_lock
from lmpretrain.run.stall_watch import StallWatch
from lmpretrain.run.step_readout import read_step
from lmpretrain.run.straggler_watch import StragglerWatch
from lmpretrain.run.train_state import TrainState

__all__ = [
    "LoopRNG",
    "PreemptionHandler",
    "StallWatch",
    "StragglerWatch",
    "TrainState",
    "check_fingerprint",
    "check_replicas_identical",
    "check_resume",
    "expert_parallel",
    "halve_on_oom",
    "local_main_first",
    "on_rank_zero",
    "provenance",
    "read_step",
    "resumed",
    "run_fingerprint",
    "run_lock",
    "runtime",
]
