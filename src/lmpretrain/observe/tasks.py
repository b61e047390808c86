"""Downstream tasks in the loop: lm-evaluation-harness scores the live model, with no export.

`TaskSuite.from_config` resolves and loads `eval.tasks` once at start-up (task names, task YAML paths,
or `builtin:<name>`), so an unknown name, a task whose dataset needs the Hub while offline, or a YAML
that does not parse stops the run before its first step. Calling the suite then hands the running
model object and the run's tokenizer to lm-evaluation-harness's Hugging Face wrapper (`HFLM`) and
runs its own `evaluate`: the metrics are lm-evaluation-harness's, computed as `simple_evaluate` would
on the exported model.

Processes: every rank scores its share of the documents (lm-evaluation-harness's own split, every
world_size-th document), the shares are padded to the same number of requests and the per-document
scores are gathered on rank 0 (then broadcast). The padding makes every rank run the same number of
forward passes, which a sharded (FSDP2) model needs: each of its forwards gathers parameters from all
ranks. Requests are scored one row each (`logits_cache=False`): the harness's one-token-continuation
cache would merge requests and make the per-rank forward counts differ.
"""

from __future__ import annotations

import difflib
import logging
import os
import random
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import DistributedType

from lmpretrain.data.next_line_task import ensure_next_line_task
from lmpretrain.errors import ConfigError
from lmpretrain.run.downloads import local_main_first

BUILTIN_PREFIX = "builtin:"
BUILTIN_TASKS: dict[str, Callable[[], Path]] = {"python_next_line": ensure_next_line_task}
FEWSHOT_SEED = 1234  # lm-evaluation-harness's default fewshot_random_seed (simple_evaluate)


def resolve_task(spec: str) -> str:
    """`builtin:<name>` -> the generated task YAML's path (built on first use); anything else as is."""
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX) :]
        if name not in BUILTIN_TASKS:
            raise KeyError(f"unknown built-in task {spec!r}; built-in: {', '.join(_builtin_names())}")
        return str(BUILTIN_TASKS[name]())
    return spec


def _builtin_names() -> list[str]:
    return [BUILTIN_PREFIX + name for name in BUILTIN_TASKS]


def _is_path(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml")) or os.sep in spec


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _metric_name(key: str) -> str | None:
    """lm-evaluation-harness's result key `acc,none` -> `acc` (`acc_<filter>` for other filters);
    None for what is not a metric (stderr, alias, sample counts)."""
    metric, _, filt = key.partition(",")
    if not filt or "_stderr" in metric:
        return None
    return metric if filt == "none" else f"{metric}_{filt}"


@contextmanager
def _rng_untouched():
    """The training trajectory must not depend on whether tasks ran: restore every global RNG after."""
    py, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(np_state)


def _live_lm(model, tokenizer, accelerator, batch_size: int, dtype: torch.dtype | None):
    """lm-evaluation-harness's HFLM over the model object; HFLM assumes one process when given an object,
    so it is told the run's rank and world size, which switches on the harness's own split and gather."""
    from lm_eval.models.huggingface import HFLM

    harness_log = logging.getLogger("lm_eval")
    level = harness_log.level
    harness_log.setLevel(logging.ERROR)  # its warnings about model objects assume a standalone launch
    try:
        lm = HFLM(
            pretrained=model,
            tokenizer=tokenizer,
            batch_size=batch_size,
            logits_cache=False,
            mixed_precision_dtype=dtype,
        )
    finally:
        harness_log.setLevel(level)
    lm._rank, lm._world_size = accelerator.process_index, accelerator.num_processes
    lm.accelerator = accelerator
    return lm


def _loaded_or_refused(e, source: str) -> dict:
    problems: list[str] = []
    loaded = _load_tasks(e.tasks, e.tasks_fewshot, problems)
    if problems:
        raise ConfigError(problems, source=source)
    return loaded


class TaskSuite:
    """The loaded `eval.tasks`, and when to run them (`eval.tasks_every`)."""

    def __init__(self, cfg, loaded: dict, tokenizer, accelerator, precision):
        e = cfg.eval
        self.loaded = loaded
        self.every, self.limit, self.fewshot = e.tasks_every, e.tasks_limit, e.tasks_fewshot
        self.batch_size, self.max_steps = e.batch_size, cfg.train.max_steps
        self.tokenizer, self.accelerator = tokenizer, accelerator
        self.dtype = getattr(precision, "dtype", precision)  # a MixedPrecision or a dtype (None = fp32)
        self._lm = None

    @classmethod
    def from_config(cls, cfg, tokenizer, accelerator, precision) -> TaskSuite:
        """Resolve and load `cfg.eval.tasks` (every rank); every problem in one ConfigError."""
        e = cfg.eval
        problems = []
        if e.tasks_every < 0:
            problems.append(f"eval.tasks_every must be >= 0 (0 = only at the end), got {e.tasks_every}")
        elif e.tasks and e.tasks_every and (not e.every or e.tasks_every % e.every):
            problems.append(
                f"eval.tasks_every={e.tasks_every} must be a multiple of eval.every={e.every}: tasks run "
                "with a held-out evaluation (or set eval.tasks_every=0 to run them only at the end)"
            )
        if e.tasks_limit is not None and e.tasks_limit < 1:
            problems.append(f"eval.tasks_limit must be >= 1 or null (all examples), got {e.tasks_limit}")
        if e.tasks_fewshot < 0:
            problems.append(f"eval.tasks_fewshot must be >= 0, got {e.tasks_fewshot}")
        loaded: dict = {"tasks": {}, "groups": {}, "group_map": {}}
        if e.tasks and not problems:
            # one process per machine fetches the task data, the others read its cache
            loaded = local_main_first(
                lambda: _loaded_or_refused(e, f"{cfg.config_path} (eval.tasks)"), accelerator
            )
        if getattr(accelerator, "distributed_type", None) == DistributedType.FSDP:  # (None: no processes yet)
            problems += _unsynchronised_under_fsdp(loaded)
        if problems:
            raise ConfigError(problems, source=f"{cfg.config_path} (eval.tasks)")
        return cls(cfg, loaded, tokenizer, accelerator, precision)

    def __bool__(self) -> bool:
        return bool(self.loaded["tasks"])

    def describe(self) -> str:
        if not self:
            return "downstream tasks: none (eval.tasks)"
        when = f"every {self.every} steps and at the end" if self.every else "at the end"
        sizes = ", ".join(
            f"{name} ({len(task.eval_docs)} examples)" for name, task in self.loaded["tasks"].items()
        )
        limit = f"the first {self.limit} of each" if self.limit else "all examples"
        return (
            f"downstream tasks (lm-evaluation-harness, {self.fewshot}-shot, {limit}, {when}): {sizes}; "
            f"{self.accelerator.num_processes} rank(s) share the documents"
        )

    def due(self, step: int) -> bool:
        return bool(self) and (step == self.max_steps or bool(self.every and step % self.every == 0))

    def run_if_due(self, model, step: int) -> dict:
        """`eval/<task>/<metric>` and `perf/tasks_s` when the tasks are due at `step`, else {}. Every rank."""
        return self(model) if self.due(step) else {}

    def __call__(self, model) -> dict:
        """Score the (possibly wrapped) live model on every task; the same metrics on every rank."""
        from accelerate.utils import broadcast_object_list
        from lm_eval.evaluator import evaluate

        acc = self.accelerator
        start = time.perf_counter()
        inner = acc.unwrap_model(model)  # DDP's module; FSDP2 shards in place, so the model itself
        was_training = inner.training
        if self._lm is None:
            self._lm = _live_lm(inner, self.tokenizer, acc, self.batch_size, self.dtype)
        inner.eval()
        try:
            with torch.no_grad(), _rng_untouched():
                for task in self.loaded["tasks"].values():
                    task.set_fewshot_seed(FEWSHOT_SEED)  # the same few-shot examples at every evaluation
                results = evaluate(
                    self._lm, self.loaded, limit=self.limit, bootstrap_iters=0, log_samples=False
                )
        finally:
            inner.train(was_training)
        metrics = {}
        if results is not None:  # rank 0
            for task, values in results["results"].items():
                for key, value in values.items():
                    name = _metric_name(key)
                    if name is not None and isinstance(value, (int, float)):
                        metrics[f"eval/{task}/{name}"] = float(value)
        if acc.num_processes > 1:
            metrics = broadcast_object_list([metrics], from_process=0)[0]
        metrics["perf/tasks_s"] = time.perf_counter() - start
        return metrics


def _unsynchronised_under_fsdp(loaded: dict) -> list[str]:
    """Generating tasks cannot run on a sharded model: the harness's `generate_until` calls
    `model.generate` on each rank's own requests, which stop after different numbers of tokens, and
    each forward of an FSDP2 model gathers parameters from every rank: the ranks' collectives no longer
    pair up and the run hangs until run.collective_timeout_s."""
    generating = [name for name, task in loaded["tasks"].items() if task.OUTPUT_TYPE == "generate_until"]
    if not generating:
        return []
    return [
        f"eval.tasks: {', '.join(generating)} generate text (output_type generate_until), which a sharded "
        "(FSDP2) model cannot do in the loop: each rank would generate a different number of tokens and "
        "the ranks' forwards stop pairing up. Remove it from eval.tasks (score it on the exported final/ "
        "with lm_eval), or launch with DDP (configs/accelerate/ddp.yaml)"
    ]


def _load_tasks(specs: list[str], fewshot: int, problems: list[str]) -> dict:
    """lm-evaluation-harness's TaskManager.load of every spec that checks out; problems appended."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    resolved = []
    for spec in specs:
        try:
            path = resolve_task(spec)
        except KeyError as err:
            problems.append(f"eval.tasks: {err.args[0]}")
            continue
        if _is_path(path):
            if not Path(path).is_file():
                problems.append(f"eval.tasks: task file {path} does not exist")
                continue
            try:
                config = load_yaml(path)
            except Exception as err:  # yaml errors, a missing !function module, ...
                problems.append(f"eval.tasks: task file {path} does not parse: {type(err).__name__}: {err}")
                continue
            if not isinstance(config, dict) or not ("task" in config or "group" in config):
                problems.append(f"eval.tasks: task file {path} has no 'task' (or 'group') key")
                continue
        resolved.append((spec, path))
    names = [path for _, path in resolved if not _is_path(path)]
    # Indexing the harness's own ~15k task YAMLs takes tens of seconds: only when a name needs it.
    manager = TaskManager(include_defaults=bool(names))
    known = set(manager.all_tasks)
    loaded: dict = {"tasks": {}, "groups": {}, "group_map": {}}
    for spec, path in resolved:
        if not _is_path(path) and path not in known:
            near = difflib.get_close_matches(path, sorted(known), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            problems.append(
                f"eval.tasks: unknown task {spec!r}{hint} (lm-evaluation-harness task names, task YAML "
                f"paths, or {', '.join(_builtin_names())})"
            )
            continue
        try:
            one = manager.load([path])
        except ConnectionError as err:
            offline = " and the Hub is offline (HF_HUB_OFFLINE=1)" if _hub_offline() else ""
            problems.append(
                f"eval.tasks: {spec!r} needs the Hugging Face Hub for its dataset{offline} ({err}); run once "
                "with the Hub reachable to cache it, or remove it from eval.tasks"
            )
            continue
        except Exception as err:  # the harness raises what its loaders raise: say which task and why
            problems.append(f"eval.tasks: {spec!r} could not be loaded: {type(err).__name__}: {err}")
            continue
        for key in loaded:
            loaded[key].update(one[key])
    for task in loaded["tasks"].values():
        # as simple_evaluate(num_fewshot=...) does: a task whose config pins 0-shot stays 0-shot
        if task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=fewshot)
    return loaded
