"""How a checkpoint stores a model and its optimizer; `checkpoint.py` around it owns the atomic protocol,
the stateful objects, discovery and retention.

* ``full``: whole tensors gathered to rank 0, which writes ``model.safetensors`` (tied aliases stored once,
  re-created on load) and ``optimizer.pt`` (the whole optimizer state, keyed by parameter names, so it
  loads into DDP and FSDP2 models alike). At load rank 0 alone reads them and broadcasts each tensor
  into the other ranks' own (``broadcast_from_rank0``), so no other rank ever holds a second copy.
* ``sharded``: ``dcp/``, written with ``torch.distributed.checkpoint``: each rank writes the shards it
  holds (no rank ever holds the whole state), and a load reshards onto any number of processes.
* averages of the weights (an EMA, ``averages={"ema": ...}``: name -> {parameter name: tensor}, DTensors
  under FSDP2): ``<name>.safetensors`` of whole tensors in format ``full``, ``averages/<name>/...`` inside
  ``dcp/`` (each rank its shards) in format ``sharded``; loaded into the live tensors in place.
* DeepSpeed: ``model.safetensors`` from rank 0 plus the engine's own ``deepspeed/`` directory (its ZeRO
  optimizer partitions, one file per rank, float32 master weights, loss scaler).

A writer runs its collectives on every rank whatever failed before (a rank that skipped one would leave
the others waiting forever) and returns the first error with a Future for the file writing: already
done, or running in a background thread when the save is async.
"""

from __future__ import annotations

import json
import os
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from accelerate import PartialState
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from lmpretrain.errors import CheckpointError
from lmpretrain.run.distributed import broadcast_object
from lmpretrain.update.normuon import SECOND_MOMENT

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
DEEPSPEED_DIR = "deepspeed"
DCP_DIR = "dcp"
DCP_METADATA = f"{DCP_DIR}/.metadata"
_ALIASES_KEY = "lmpretrain.tied_aliases"
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


# ---- small helpers shared with checkpoint.py ------------------------------------------------------------


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entries to disk (a directory fsync makes renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and the directories themselves (for files another library wrote)."""
    for p in sorted(path.rglob("*")):
        fsync_path(p)
    fsync_path(path)


class _Writes:
    """The file torch.save writes to, keeping the OSError of a failed write: torch swallows it and reports
    an opaque "unexpected pos ... vs ..." RuntimeError instead of "No space left on device"."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        return self._kept(self.f.write, data)

    def flush(self):
        return self._kept(self.f.flush)

    def _kept(self, fn, *args):
        try:
            return fn(*args)
        except OSError as err:
            self.error = self.error or err
            raise


def torch_save_synced(obj, path: Path) -> None:
    with open(path, "wb") as f:
        writes = _Writes(f)
        try:
            torch.save(obj, writes)
        except RuntimeError as err:
            if writes.error is None:
                raise
            raise OSError(writes.error.errno, writes.error.strerror, str(path)) from err
        f.flush()
        os.fsync(f.fileno())


def attempt(previous: BaseException | None, fn, *args) -> BaseException | None:
    """Run fn unless an earlier step failed; return the first error (raised later, on every rank)."""
    if previous is not None:
        return previous
    try:
        fn(*args)
    except Exception as err:  # noqa: BLE001 - re-raised by the checkpointer after the ranks agree
        return err
    return None


def done() -> Future:
    """A Future of a write that already happened."""
    future: Future = Future()
    future.set_result(None)
    return future


def manifest_problem(fmt: str, manifest: dict) -> str | None:
    """What a committed checkpoint of format ``fmt`` lacks, or None."""
    if fmt == "sharded":
        return None if DCP_METADATA in manifest else f"manifest lacks {DCP_METADATA} (format sharded)"
    if fmt != "full":
        return f"unknown format {fmt!r}"
    if MODEL_FILE not in manifest:
        return f"manifest lacks {MODEL_FILE} (format full)"
    if OPTIMIZER_FILE not in manifest and not any(n.startswith(f"{DEEPSPEED_DIR}/") for n in manifest):
        return f"manifest lacks {OPTIMIZER_FILE} (or a {DEEPSPEED_DIR}/ optimizer)"
    return None


# ---- tensors ----------------------------------------------------------------------------------------------


def _alias_key(t: torch.Tensor) -> tuple:
    """Equal for two tensors that are the same view of the same memory (tied weights)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _split_tied(state_dict: dict) -> tuple[dict, dict]:
    """Drop aliases of tensors already present (tied weights): safetensors refuses shared storage."""
    unique, aliases, seen = {}, {}, {}
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(
                f"model state entry {name!r} is a {type(t).__name__}, not a tensor; "
                f"model.safetensors can only hold tensors"
            )
        key = _alias_key(t) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        # safetensors needs contiguous tensors; this copies only the (rare) non-contiguous ones.
        unique[name] = t if t.is_contiguous() else t.contiguous()
    return unique, aliases


def _snapshot(tree, memo: dict | None = None):
    """A copy of ``tree`` whose tensors are CPU clones (aliases stay aliases): what a background write
    reads while training goes on changing the live tensors."""
    memo = {} if memo is None else memo
    if isinstance(tree, torch.Tensor):
        key = _alias_key(tree)
        if key not in memo:
            memo[key] = tree.detach().to("cpu", copy=True)
        return memo[key]
    if isinstance(tree, dict):
        return {k: _snapshot(v, memo) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_snapshot(v, memo) for v in tree)
    return tree


def _gathered(tensors: dict) -> dict:
    """Whole CPU copies of {name: tensor}, DTensor shards gathered (a collective on every rank)."""
    return {k: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu() for k, t in tensors.items()}


@torch.no_grad()
def _scatter_into(live: dict, whole: dict) -> None:
    """Copy whole tensors into the live ones; a DTensor takes its own shard (split like the parameter)."""
    missing = sorted(set(live) - set(whole))
    if missing:
        raise CheckpointError(f"the saved average lacks {len(missing)} parameters, e.g. {missing[0]!r}")
    for name, t in live.items():
        if isinstance(t, DTensor):
            src = distribute_tensor(whole[name].to(t.device, t.dtype), t.device_mesh, t.placements)
            t.to_local().copy_(src.to_local())
        else:
            t.copy_(whole[name])


def _write_model(weights: dict, path: Path) -> None:
    tensors, aliases = _split_tied(weights)
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt", _ALIASES_KEY: json.dumps(aliases)})
    fsync_path(path)


def _read_model(path: Path) -> dict:
    weights = safetensors.torch.load_file(path, device="cpu")
    with safetensors.safe_open(path, framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get(_ALIASES_KEY, "{}"))
    for alias, name in aliases.items():
        weights[alias] = weights[name]
    return weights


def _optimizer_state(model, optimizer, full: bool) -> dict:
    if not optimizer.state:
        # get_optimizer_state_dict would initialise an unstepped optimizer with a fake step
        # (moments 0, step 1), changing the live run; save the hyperparameters only.
        return {
            "state": {},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        }
    return get_optimizer_state_dict(model, optimizer, options=_FULL if full else StateDictOptions())


def _set_optimizer(where: Path, model, optimizer, optim_state: dict, options, moments: bool) -> None:
    """Load ``optim_state``; ``moments``: whether it has per-parameter state. With
    ``options.broadcast_from_rank0`` only rank 0's holds that state, the others' arrives by broadcast."""
    groups = optim_state["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{where} has {len(groups)} parameter groups, the optimizer has {len(optimizer.param_groups)}"
        )
    if not moments:
        optimizer.state.clear()
        for live, saved in zip(optimizer.param_groups, groups, strict=True):
            live.update({k: v for k, v in saved.items() if k != "params"})
        return
    # torch's loader fails with a bare KeyError on group keys the live optimizer lacks (e.g.
    # 'initial_lr' when the scheduler is built after loading); the load overwrites every group value
    # anyway, so add the missing ones first.
    for live, saved in zip(optimizer.param_groups, groups, strict=True):
        for key, value in saved.items():
            if key != "params":
                live.setdefault(key, value)
    replicated = not any(isinstance(p, DTensor) for p in model.parameters())
    if options.broadcast_from_rank0 and replicated:
        _broadcast_optimizer(optimizer, optim_state, groups)
    else:
        set_optimizer_state_dict(model, optimizer, optim_state, options=options)
    for live, saved in zip(optimizer.param_groups, groups, strict=True):  # it turns tuples into lists
        for key, value in saved.items():
            if isinstance(value, tuple) and isinstance(live.get(key), list):
                live[key] = tuple(live[key])


@dataclass(frozen=True)
class _Moment:
    """A state tensor of rank 0, announced to the others by its shape and dtype."""

    shape: tuple
    dtype: torch.dtype


def _broadcast_optimizer(optimizer, optim_state: dict, groups: list[dict]) -> None:
    """Rank 0's whole optimizer state (``optim_state``, keyed by parameter names; empty elsewhere) into
    every rank's optimizer, for replicated parameters. Each moment is broadcast into the tensor that will
    hold it: the live one when the optimizer has stepped, else one allocated once, so no rank holds a
    second copy. torch's set_optimizer_state_dict first fills the optimizer with zero moments (a fake
    step) and then broadcasts into new tensors: twice the moments at the peak (rank 1 at a resume: 696 MiB
    extra instead of 356, docs/checkpoints.md)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = [name for group in groups for name in group["params"]]
    if len(names) != len(params):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(names)} parameters, this one {len(params)}"
        )
    state = optim_state.get("state", {})
    # What each parameter's state holds: tensors of rank 0 (their shape and dtype; a 0-dim one, the step,
    # travels by value) and plain values; the others learn it in one small broadcast.
    layout = [
        {
            k: _Moment(tuple(v.shape), v.dtype) if torch.is_tensor(v) and v.dim() > 0 else v
            for k, v in state[name].items()
        }
        if name in state
        else None
        for name in names
    ]
    layout = broadcast_object(layout, PartialState())
    loaded = {}
    for i, (param, entries) in enumerate(zip(params, layout, strict=True)):
        if entries is None:
            continue
        live, mine = optimizer.state.get(param, {}), state.get(names[i], {})
        loaded[i] = {}
        for k, how in entries.items():
            into = how
            if isinstance(how, _Moment):
                into = live.get(k)
                fits = torch.is_tensor(into) and into.shape == how.shape and into.dtype == how.dtype
                if k in mine:  # rank 0: the values read from the file
                    into = into.copy_(mine[k]) if fits else mine[k].to(param.device)
                elif not fits:
                    into = torch.empty(how.shape, dtype=how.dtype, device=param.device)
                dist.broadcast(into, src=0)
            loaded[i][k] = into
    indexed, start = [], 0
    for group in groups:
        indexed.append({**group, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    optimizer.load_state_dict({"state": loaded, "param_groups": indexed})


@contextmanager
def _single_process_is_intended():
    """DCP warns on every single-process save/load that it assumes one process: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


# ---- the formats ---------------------------------------------------------------------------------------


class Files:
    """Writes and reads a model and its optimizer in one format; ``state`` is the Accelerator (or
    PartialState) of this process."""

    description = ""

    def __init__(self, state, async_save: bool = False):
        self.state = state
        self.async_save = async_save
        self.distributed = state.num_processes > 1 and dist.is_available() and dist.is_initialized()

    def write(self, model, optimizer, tmp: Path, error, averages=None) -> tuple[BaseException | None, Future]:
        """`averages`: {name: {parameter name: tensor}} written beside the model (see the module docstring)."""
        raise NotImplementedError

    def load(self, path: Path, manifest: dict, model, optimizer, averages=None) -> None:
        """`averages`: {name: {parameter name: live tensor}}, filled in place."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the writer holds (threads, process groups)."""


class FullFiles(Files):
    description = "whole weights and optimizer state gathered to rank 0 (model.safetensors, optimizer.pt)"

    def __init__(self, state, async_save: bool = False):
        super().__init__(state, async_save)
        self._thread: ThreadPoolExecutor | None = None

    def write(self, model, optimizer, tmp, error, averages=None):
        # Full on main, empty elsewhere (sharded models are gathered: a collective on every rank).
        weights = get_model_state_dict(model, options=_FULL)
        optim_state = _optimizer_state(model, optimizer, full=True)
        whole = {name: _gathered(tensors) for name, tensors in (averages or {}).items()}  # every rank
        if not self.state.is_main_process or error is not None:
            return error, done()
        if not self.async_save:
            return attempt(None, self._write, weights, optim_state, whole, tmp), done()
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmpretrain-checkpoint")
        return None, self._thread.submit(self._write, *_snapshot((weights, optim_state, whole)), tmp)

    @staticmethod
    def _write(weights: dict, optim_state: dict, averages: dict, tmp: Path) -> None:
        _write_model(weights, tmp / MODEL_FILE)
        torch_save_synced(optim_state, tmp / OPTIMIZER_FILE)
        for name, tensors in averages.items():
            safetensors.torch.save_file(tensors, tmp / f"{name}.safetensors", metadata={"format": "pt"})
            fsync_path(tmp / f"{name}.safetensors")

    def load(self, path, manifest, model, optimizer, averages=None):
        if OPTIMIZER_FILE not in manifest:
            raise CheckpointError(
                f"{path} was written by a DeepSpeed run (its optimizer state is partitioned in "
                f"{DEEPSPEED_DIR}/): resume it under DeepSpeed with the same number of processes"
            )
        reads = self.state.is_main_process or not self.distributed
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.distributed)
        set_model_state_dict(model, _read_model(path / MODEL_FILE) if reads else {}, options=options)
        optim_state = (
            torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True) if reads else {}
        )
        moments = bool(optim_state.get("state"))
        if self.distributed:  # the others learn the (small) groups and whether there are moments at all
            groups, moments = broadcast_object((optim_state.get("param_groups"), moments), self.state)
            optim_state = optim_state if reads else {"state": {}, "param_groups": groups}
        _set_optimizer(path / OPTIMIZER_FILE, model, optimizer, optim_state, options, moments)
        for name, live in (averages or {}).items():
            _scatter_into(live, safetensors.torch.load_file(path / f"{name}.safetensors", device="cpu"))

    def close(self):
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None


def _without_absent_second_moments(optim_state: dict, where: Path) -> dict:
    """The layout DCP reads into, less NorMuon's second moments the checkpoint lacks (a Muon checkpoint
    resumed as NorMuon): they start at zero at the first step, as in a fresh run. DCP would refuse every
    missing entry."""
    saved = dcp.FileSystemReader(str(where)).read_metadata().state_dict_metadata
    for fqn, entries in optim_state["state"].items():
        if SECOND_MOMENT in entries and f"optimizer.state.{fqn}.{SECOND_MOMENT}" not in saved:
            del entries[SECOND_MOMENT]
    return optim_state


class ShardedFiles(Files):
    description = "torch.distributed.checkpoint, each rank writes the shards it holds (dcp/)"

    def __init__(self, state, async_save: bool = False):
        super().__init__(state, async_save)
        self._group = None
        if async_save and self.distributed:
            # DCP's background save runs collectives; on the training group they could interleave with
            # the loop's own and deadlock, so it gets a group of its own (gloo: it stages on CPU).
            self._group = dist.new_group(backend="gloo")

    def write(self, model, optimizer, tmp, error, averages=None):
        state = {"model": get_model_state_dict(model)}  # DTensor shards under FSDP2: this rank's share
        if averages:
            state["averages"] = averages
        optim_state = _optimizer_state(model, optimizer, full=False)
        if optim_state["state"]:
            state["optimizer"] = optim_state
        elif self.state.is_main_process:  # hyperparameters only (nothing stepped yet): one small file
            error = attempt(error, torch_save_synced, optim_state, tmp / OPTIMIZER_FILE)
        write = done()
        # DCP's save is a collective: every rank calls it, even after an error elsewhere.
        try:
            where, alone = str(tmp / DCP_DIR), not self.distributed
            with _single_process_is_intended():
                if self.async_save:
                    write = dcp.async_save(
                        state, checkpoint_id=where, process_group=self._group, no_dist=alone
                    )
                else:
                    dcp.save(state, checkpoint_id=where, no_dist=alone)
        except Exception as err:  # noqa: BLE001 - re-raised by the checkpointer after the ranks agree
            error = error or err
        return error, write

    def load(self, path, manifest, model, optimizer, averages=None):
        # The live model and optimizer give DCP the layout to read into: this rank's shards under FSDP2,
        # whole tensors otherwise (DCP reshards whatever number of ranks wrote them). The averages' live
        # tensors are read into in place.
        state = {"model": get_model_state_dict(model)}
        if averages:
            state["averages"] = averages
        groups_only = OPTIMIZER_FILE in manifest
        if not groups_only:
            state["optimizer"] = _without_absent_second_moments(
                get_optimizer_state_dict(model, optimizer), path / DCP_DIR
            )
        with _single_process_is_intended():
            dcp.load(state, checkpoint_id=str(path / DCP_DIR), no_dist=not self.distributed)
        set_model_state_dict(model, state["model"])
        if groups_only:
            optim_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        else:
            optim_state = state["optimizer"]
        moments = bool(optim_state["state"])
        _set_optimizer(path / DCP_DIR, model, optimizer, optim_state, StateDictOptions(), moments)

    def close(self):
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None


class DeepSpeedFiles(Files):
    description = (
        "whole weights from rank 0 (model.safetensors) + DeepSpeed's partitioned optimizer (deepspeed/)"
    )

    def write(self, model, optimizer, tmp, error, averages=None):  # averages: refused under DeepSpeed
        # A DeepSpeed engine's module holds whole weights (ZeRO 1/2); its optimizer partitions are its own.
        if self.state.is_main_process:
            error = attempt(
                error, _write_model, get_model_state_dict(model.module, options=_FULL), tmp / MODEL_FILE
            )
        # A collective (every rank writes its own partition): called on every rank whatever failed before.
        try:
            model.save_checkpoint(str(tmp), tag=DEEPSPEED_DIR, save_latest=False)
        except Exception as err:  # noqa: BLE001 - re-raised by the checkpointer after the ranks agree
            error = error or err
        return error, done()

    def load(self, path, manifest, model, optimizer, averages=None):
        if OPTIMIZER_FILE in manifest or DCP_METADATA in manifest:
            raise CheckpointError(
                f"{path} was written without DeepSpeed; DeepSpeed cannot load it: resume it with the "
                "launch config that wrote it"
            )
        ranks = sum(1 for name in manifest if name.startswith("rank-"))
        if ranks != self.state.num_processes:
            raise CheckpointError(
                f"{path} holds DeepSpeed ZeRO optimizer partitions for {ranks} ranks but "
                f"{self.state.num_processes} are running: resume with {ranks} processes"
            )
        # The engine restores weights, fp32 master copies, moments and its loss scaler from its own files.
        loaded, _ = model.load_checkpoint(
            str(path), tag=DEEPSPEED_DIR, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if loaded is None:
            raise CheckpointError(f"DeepSpeed could not load {path / DEEPSPEED_DIR}")
