"""Atomic, valid-only checkpoints of a model, its optimizer and the run's stateful objects; resume
discovery; retention.

The recipe hands the checkpointer its model, optimizer and a dict of objects that have
``state_dict()``/``load_state_dict()`` (torchtitan's ``states={...}``), and gets them back restored::

    states = {"train": train_state, "scheduler": scheduler, "data": PerRank(train_data, merge), ...}
    checkpointer.save(step, model=model, optimizer=optimizer, states=states, meta={...})
    checkpointer.load(path, model=model, optimizer=optimizer, states=states)

A state is the same on every rank and saved once (rank 0's); wrapped in ``PerRank`` every rank saves
its own (RNG, data position), and on load a ``merge`` function combines all ranks' saved states so a
run resumes onto any number of processes. ``averages={"ema": ema}`` are weight averages: objects whose
``state_dict()`` is {parameter name: live tensor} sharded like the parameters, written with the model in
its format and read back into those tensors in place (one absent from the checkpoint is ``restart()``-ed). States hold plain data (dicts, lists, ints, floats, bools,
strs, None, tensors), checked before anything is written. A checkpoint is
``<output_dir>/checkpoints/step-NNNNNNNN/`` holding:

* ``meta.json``          step, world size, format, and the caller's metadata (config, fingerprint, the
                         eval loss of an eval run at this step): read without loading any tensor
* ``states.pt``          the shared states; ``rank-00000.pt`` ... the ``PerRank`` states of each rank
* the model and optimizer in format ``full`` (``model.safetensors``, ``optimizer.pt``; default without
  FSDP2), ``sharded`` (``dcp/``, each rank writes its shards; default under FSDP2) or DeepSpeed's
  (``model.safetensors`` + ``deepspeed/``): see checkpoint_formats.py
* ``COMPLETE``           JSON manifest ``{file: size_in_bytes}`` of every other file, written last

Write protocol (every rank calls ``save``): refuse non-finite weights; main creates
``checkpoints/.tmp-step-N-<nonce>/``; every rank writes and fsyncs its files there; all ranks agree
nothing failed; main writes ``COMPLETE``, fsyncs it and the directory, renames the directory to
``step-N`` and fsyncs ``checkpoints/``. The rename is the commit: a directory named ``step-N`` appears
complete, with its marker, or not at all. The marker and its sizes are a second defence for copies made
by other tools and truncated files. A crash at any point leaves the older checkpoints untouched;
leftover ``.tmp-*`` directories are removed by the next save.

With ``async_save`` the weights and optimizer state are copied to CPU memory (a snapshot) and written
by a background thread while training continues; the commit (all ranks agree, marker, rename) happens
once every rank's write is complete: at the first ``poll()`` after that, or ``wait()``. Until then the
step exists only as a ``.tmp-*`` directory, so a kill during the write leaves the previous checkpoint
the newest valid one.

Every ``torch.load`` here uses ``weights_only=True``. DCP's reader (format ``sharded``) and DeepSpeed's
unpickle their own metadata: resume only checkpoints you trust.
"""

import errno
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor

from lmpretrain.checkpoint.formats import (
    DeepSpeedFiles,
    Files,
    FullFiles,
    ShardedFiles,
    attempt,
    fsync_path,
    fsync_tree,
    manifest_problem,
    torch_save_synced,
)
from lmpretrain.errors import CheckpointError, ConfigError
from lmpretrain.run.distributed import any_rank, broadcast_int, broadcast_object, first_problem
from lmpretrain.run.preemption import launcher_grace_s

logger = logging.getLogger(__name__)

META_FILE = "meta.json"
STATES_FILE = "states.pt"
MARKER_FILE = "COMPLETE"
STEP_DIR = re.compile(r"^step-(\d{8,})$")
RANK_FILE = re.compile(r"^rank-(\d{5})\.pt$")
PER_RANK_FILE = re.compile(r"^(?:rank-(\d{5})\.pt|dcp/__(\d+)_\d+\.distcp)$")


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass
class PerRank:
    """A state that differs by rank: every rank saves its own.

    On load, ``merge`` (given saved ranks' states, in rank order) returns the state this rank loads, so a
    different number of processes can resume (e.g. the data streams of all ranks); ``reads(saved world
    size)`` names the saved ranks whose states it needs (default: all), so a rank opens those files, not
    the whole world's. Without ``merge`` each rank loads its own; ranks beyond the saved ones keep theirs
    (with a warning).
    """

    obj: object
    merge: Callable[[list], object] | None = None
    reads: Callable[[int], list[int]] | None = None

    def saved_ranks(self, rank: int, saved_world: int) -> list[int]:
        if self.merge is None:
            return [rank] if rank < saved_world else []
        return sorted(self.reads(saved_world)) if self.reads is not None else list(range(saved_world))


# ---- small helpers ---------------------------------------------------------------------------------


def _write_text_synced(text: str, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _remove_dir(path: Path) -> None:
    """Delete a checkpoint directory marker first, so a half-deleted directory never looks valid."""
    (path / MARKER_FILE).unlink(missing_ok=True)
    shutil.rmtree(path)


_PLAIN = (int, float, bool, str, type(None), torch.Tensor)


def _check_plain(obj, where: str) -> None:
    """Raise if ``obj`` holds anything ``torch.load(weights_only=True)`` would refuse to read back."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where} has a key {k!r} of type {type(k).__name__}; use str or int keys")
            _check_plain(v, f"{where}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
    elif not isinstance(obj, _PLAIN):
        raise TypeError(
            f"{where} is a {type(obj).__module__}.{type(obj).__name__}; checkpoints hold only "
            f"dicts, lists, ints, floats, bools, strs, None and tensors (convert it, e.g. int(x))"
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nonfinite_parameter(model) -> str | None:
    """The name of a parameter of this rank's share holding inf/NaN, or None."""
    for name, p in model.named_parameters():
        local = _local(p.detach())
        if local.is_floating_point() and not torch.isfinite(local).all():
            return name
    return None


# ---- validation --------------------------------------------------------------------------------------


def checker_of(name: str, world_size: int) -> int:
    """The rank that checks file ``name`` of a checkpoint against its manifest when ``world_size`` ranks
    load it: a rank's own files (``rank-N.pt``, its DCP shards ``dcp/__N_*.distcp``) by rank N mod the world
    size, the shared ones by rank 0. Every file is checked once, and a rank's share does not grow with the
    world: at 1,024 ranks a resume is not a million stats on one shared filesystem."""
    match = PER_RANK_FILE.match(name)
    return 0 if match is None else int(match.group(1) or match.group(2)) % world_size


def checkpoint_problem(path: Path, checks: Callable[[str], bool] | None = None) -> str | None:
    """Why ``path`` is not a loadable checkpoint, or None when it is (marker, manifest, step, and the
    sizes of the manifest's files, or of those ``checks`` selects by name)."""
    path = Path(path)
    if not path.is_dir():
        return "not a directory"
    match = STEP_DIR.match(path.name)
    if not match:
        return "directory name is not step-NNNNNNNN"
    marker = path / MARKER_FILE
    if not marker.is_file():
        return f"no {MARKER_FILE} marker (the save did not finish)"
    try:
        manifest = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return f"unreadable {MARKER_FILE} marker ({err})"
    if not isinstance(manifest, dict) or not all(
        isinstance(k, str) and isinstance(v, int) for k, v in manifest.items()
    ):
        return f"{MARKER_FILE} is not a {{file: size}} manifest"
    for required in (META_FILE, STATES_FILE, rank_file(0)):
        if required not in manifest:
            return f"manifest lacks {required}"
    ranks = sorted(int(m.group(1)) for m in map(RANK_FILE.match, manifest) if m)
    if ranks != list(range(len(ranks))):
        return f"manifest has rank files {ranks}, not 0..{len(ranks) - 1}"
    for name, size in manifest.items():
        if checks is not None and not checks(name):
            continue
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        actual = f.stat().st_size
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size} (truncated or overwritten)"
    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return f"unreadable {META_FILE} ({err})"
    if not isinstance(meta, dict) or meta.get("step") != int(match.group(1)):
        return f"{META_FILE} does not say step {int(match.group(1))} (the directory name)"
    if meta.get("world_size") != len(ranks):
        return f"{len(ranks)} rank files for world size {meta.get('world_size')}"
    return manifest_problem(meta.get("format"), manifest)


def _read_meta(path: Path) -> dict:
    return json.loads((path / META_FILE).read_text(encoding="utf-8"))


def check_output_dir_writable(output_dir) -> None:
    """Fail before training if checkpoints could not be created, written and renamed in ``output_dir``."""
    out = Path(output_dir)
    probe = out / f".write-test-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.mkdir()
        _write_text_synced("ok", probe / "probe")
        renamed = probe.with_name(probe.name + "-renamed")
        os.rename(probe, renamed)
        shutil.rmtree(renamed)
    except OSError as err:
        raise CheckpointError(
            f"output_dir {str(out)!r} is not usable for checkpoints: {err.strerror or err} "
            f"({type(err).__name__} on {err.filename or out}). Checkpoints need to create, write and rename "
            f"directories there: pick another output_dir or fix the path/permissions."
        ) from err


def checkpoint_problems(format: str, async_save: bool, *, deepspeed: bool) -> list[str]:
    """What DeepSpeed's engine, which writes its own partitioned files synchronously, cannot do."""
    p = []
    if deepspeed and format == "sharded":
        p.append(
            "checkpoint.format=sharded is not supported under DeepSpeed (its engine writes its own "
            "partitioned optimizer files): use checkpoint.format=auto or full"
        )
    if deepspeed and async_save:
        p.append(
            "checkpoint.async_save=true is not supported under DeepSpeed (its engine writes synchronously): "
            "set it to false"
        )
    return p


def resolve_format(requested: str, state) -> str:
    """``checkpoint.format`` (auto | full | sharded, validated with the config): ``auto`` is sharded under
    FSDP2 and full otherwise; DeepSpeed writes full."""
    if requested == "auto":
        return "sharded" if getattr(state, "is_fsdp2", False) else "full"
    return requested


# ---- the checkpointer ------------------------------------------------------------------------------------


@dataclass
class _Pending:
    """A save whose background write has not been committed yet."""

    step: int
    tmp: Path
    final: Path
    nonce: int
    write: Future
    started: float
    stall_s: float


class Checkpointer:
    """Saves, finds, loads and prunes the checkpoints of one output dir (all ranks call save/load/poll).

    ``announce`` (e.g. the recipe's ``print``) is told about each committed checkpoint.
    """

    def __init__(
        self,
        output_dir,
        accelerator=None,
        keep_last: int = 2,
        format: str = "auto",
        async_save: bool = False,
        announce: Callable[[str], None] | None = None,
    ):
        if keep_last < 1:
            raise ValueError(
                f"keep_last must be >= 1 (got {keep_last}); the newest checkpoint is always kept"
            )
        self.output_dir = Path(output_dir)
        self.dir = self.output_dir / "checkpoints"
        self.state = accelerator if accelerator is not None else PartialState()
        self.keep_last = keep_last
        # DeepSpeed's engine owns its partitioned optimizer state and writes it in its own layout.
        self.deepspeed = self.state.distributed_type == DistributedType.DEEPSPEED
        problems = checkpoint_problems(format, async_save, deepspeed=self.deepspeed)
        if problems:
            raise ConfigError(problems)
        self.format = resolve_format(format, self.state)
        self.async_save = async_save
        self.announce = announce or (lambda line: None)
        self._pending: _Pending | None = None
        self._grace_warned = False
        self.files = self._files(self.format, async_save)  # writes the model and optimizer

    @classmethod
    def from_config(cls, output_dir, accelerator, checkpoint_cfg, announce=None) -> "Checkpointer":
        """The checkpointer `checkpoint.keep_last/format/async_save` describe; it announces each committed
        checkpoint through `announce`, by default the main process's print (accelerator.print)."""
        return cls(
            output_dir,
            accelerator,
            keep_last=checkpoint_cfg.keep_last,
            format=checkpoint_cfg.format,
            async_save=checkpoint_cfg.async_save,
            announce=announce or accelerator.print,
        )

    def _files(self, fmt: str, async_save: bool = False) -> Files:
        if self.deepspeed:
            return DeepSpeedFiles(self.state)
        return (ShardedFiles if fmt == "sharded" else FullFiles)(self.state, async_save)

    def describe(self) -> str:
        """One line on how checkpoints are written, for the start-up log."""
        mode = "async (background write, committed once complete)" if self.async_save else "sync"
        return (
            f"checkpoints: format={self.format}: {self.files.description}; {mode}; "
            f"keep_last={self.keep_last} + best eval"
        )

    # -- discovery --

    def _step_dirs(self) -> list[Path]:
        """step-* directories, newest first (by the number in the name: only for ordering)."""
        if not self.dir.is_dir():
            return []
        dirs = [p for p in self.dir.iterdir() if STEP_DIR.match(p.name) and p.is_dir()]
        return sorted(dirs, key=lambda p: int(STEP_DIR.match(p.name).group(1)), reverse=True)

    def valid_checkpoints(self) -> list[Path]:
        """Every loadable checkpoint, newest first (this process checks every file: for retention)."""
        return [p for p in self._step_dirs() if checkpoint_problem(p) is None]

    def files_problem(self, path: Path) -> str | None:
        """Why this launch cannot load ``path`` (the lowest failing rank's reason), the same on every rank,
        or None: each rank checks the structure and its share of the files (``checker_of``). Every rank must
        call it."""
        rank, world = self.state.process_index, self.state.num_processes
        problem = checkpoint_problem(path, lambda name: checker_of(name, world) == rank)
        return first_problem(problem, self.state)

    def latest(self) -> Path | None:
        """The newest checkpoint every rank can load; newer invalid ones are skipped with a warning naming
        them. Rank 0 lists the directory (listings cached per node could differ) and names the candidates
        newest first; all ranks check each one. Every rank must call it."""
        candidates = [str(p) for p in self._step_dirs()] if self.state.is_main_process else []
        tried = 0
        while path := broadcast_object(candidates[tried] if tried < len(candidates) else None, self.state):
            problem = self.files_problem(Path(path))
            if problem is None:
                return Path(path)
            if self.state.is_main_process:
                logger.warning("ignoring checkpoint %s: %s; falling back to an older one", path, problem)
            tried += 1
        return None

    def resolve_resume(self, resume: str, overwrite: bool) -> Path | None:
        """``auto``: the newest valid checkpoint or None; ``never``: None (refusing existing
        checkpoints unless ``overwrite``, which deletes them); otherwise the checkpoint at that path.

        Rank 0 decides and every rank gets its answer (or its error): ranks that listed the directory
        each on their own could pick different steps on a shared filesystem whose directory listings
        are cached per node. Each rank checks only its share of the files. Every rank must call it."""
        if resume == "auto":
            return self.latest()
        answer = None
        if self.state.is_main_process:
            try:
                answer = ("path", self._resolve_resume_here(resume, overwrite))
            except CheckpointError as err:
                answer = ("error", str(err))
        kind, value = broadcast_object(answer, self.state)  # the deletions of `never` are done by now
        if kind == "error":
            raise CheckpointError(value)
        if value is None:
            return None
        problem = self.files_problem(Path(value))
        if problem is not None:
            raise CheckpointError(f"run.resume={value!r} is not a loadable checkpoint: {problem}")
        return Path(value)

    def _resolve_resume_here(self, resume: str, overwrite: bool) -> str | None:
        if resume == "never":
            existing = self._step_dirs()
            if existing and not overwrite:
                raise CheckpointError(
                    f"run.resume=never but {self.dir} already has {len(existing)} checkpoint(s) "
                    f"(newest {existing[0].name}). Resume them with --run.resume=auto, use another output_dir, "
                    f"or pass --run.overwrite=true to delete them and start fresh."
                )
            if existing:
                # Left in place, they would be mixed with the new run's (auto-resume could pick them).
                logger.warning(
                    "run.overwrite=true: deleting %d old checkpoint(s) in %s", len(existing), self.dir
                )
                for path in existing:
                    _remove_dir(path)
            return None
        problem = checkpoint_problem(Path(resume), checks=lambda name: False)  # the files: by every rank
        if problem is not None:
            hint = ""
            if (Path(resume) / "checkpoints").is_dir():
                hint = (
                    f" (it looks like an output dir: point at one of {Path(resume) / 'checkpoints'}/step-*)"
                )
            raise CheckpointError(f"run.resume={resume!r} is not a loadable checkpoint: {problem}{hint}")
        return resume

    # -- saving --

    def _clean_leftovers(self) -> None:
        for p in self.dir.iterdir():
            if p.name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(p, ignore_errors=True)

    @staticmethod
    def _collect(states: dict) -> tuple[dict, dict]:
        """(shared, per-rank) state dicts of the objects, checked to be plain data."""
        shared, per_rank = {}, {}
        for name, obj in states.items():
            target = per_rank if isinstance(obj, PerRank) else shared
            value = (obj.obj if isinstance(obj, PerRank) else obj).state_dict()
            _check_plain(value, f"state {name!r}")
            target[name] = value
        return shared, per_rank

    def save(
        self,
        step: int,
        *,
        model,
        optimizer,
        states: dict,
        meta: dict | None = None,
        averages: dict | None = None,
    ) -> Path:
        """Write checkpoint ``step`` of ``model``, ``optimizer`` and ``states`` ({name: object with
        state_dict()}); ``meta`` is JSON metadata (its ``eval_loss`` picks the best checkpoint). Every rank
        must call it. Sync: committed and pruned on return; async: committed by a later poll()/wait()."""
        self.wait()  # one save at a time: the previous one commits first
        started = time.perf_counter()
        st = self.state
        final = self.dir / step_dir_name(step)
        # Errors are collected, agreed on by all ranks, then raised everywhere: a rank that raised
        # alone would leave the others waiting forever in the next collective.
        error: BaseException | None = None
        try:
            shared, per_rank = self._collect(states)  # first: the RNG state is captured before anything runs
            averages = {name: obj.state_dict() for name, obj in (averages or {}).items()}
            meta_json = json.dumps(
                {
                    **(meta or {}),
                    "step": step,
                    "world_size": st.num_processes,
                    "format": self.format,
                    "averages": sorted(averages),
                },
                indent=2,
                sort_keys=True,
            )
            bad = _nonfinite_parameter(model)
            if bad is not None:
                raise ValueError(
                    f"parameter {bad!r} holds inf/NaN at step {step}: a checkpoint of these weights would "
                    "resume into the same failure"
                )
        except (TypeError, ValueError) as err:
            error = err

        nonce = 0
        if st.is_main_process and error is None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                self._clean_leftovers()
            except OSError as err:
                error = err
            nonce = int.from_bytes(os.urandom(6), "little")
        nonce = broadcast_int(nonce, st)
        tmp = self.dir / f".tmp-{final.name}-{nonce:012x}"
        if st.is_main_process:
            error = attempt(error, tmp.mkdir)
        if any_rank(error is not None, st):  # also the barrier: tmp exists before anyone writes
            raise self._failed(error, tmp, f"start {final.name}")

        # Collective calls happen on every rank whatever happened before, so a write error on one
        # rank cannot leave the others waiting inside a gather.
        error, write = self.files.write(model, optimizer, tmp, error, averages)
        if st.is_main_process:
            error = attempt(error, torch_save_synced, shared, tmp / STATES_FILE)
            error = attempt(error, _write_text_synced, meta_json, tmp / META_FILE)
        rank_state = {"rank": st.process_index, "world_size": st.num_processes, "states": per_rank}
        error = attempt(error, torch_save_synced, rank_state, tmp / rank_file(st.process_index))
        if any_rank(error is not None, st):
            _settle(write)  # a background write into tmp must end before tmp is removed
            raise self._failed(error, tmp, f"write {final.name}")
        self._pending = _Pending(step, tmp, final, nonce, write, started, time.perf_counter() - started)
        if not self.async_save:
            self.wait()
        return final

    def poll(self) -> Path | None:
        """Commit a background save once every rank has finished writing it; returns its path then.
        Every rank must call it (a collective while a save is pending, nothing otherwise)."""
        if self._pending is None:
            return None
        if any_rank(not self._pending.write.done(), self.state):
            return None
        return self.wait()

    def wait(self) -> Path | None:
        """Block until the pending save is written, then commit it; returns its path (None if none)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        st = self.state
        try:
            pending.write.result()
            error = None
        except Exception as err:  # noqa: BLE001 - re-raised by _failed after the ranks agree
            error = err
        if any_rank(error is not None, st):
            raise self._failed(error, pending.tmp, f"write {pending.final.name}")
        if st.is_main_process:
            error = attempt(None, self._commit, pending.tmp, pending.final, pending.nonce)
        if any_rank(error is not None, st):
            raise self._failed(error, pending.tmp, f"commit {pending.final.name}")
        if st.is_main_process:
            self.prune()
        self._report(pending, time.perf_counter() - pending.started)
        return pending.final

    def _report(self, pending: _Pending, total_s: float) -> None:
        if self.async_save:
            how = f"written in the background in {total_s:.2f} s, training stalled {pending.stall_s:.2f} s"
        else:
            how = f"in {total_s:.2f} s"
        self.announce(f"[lmpretrain] saved checkpoint {pending.final} ({how})")
        grace = launcher_grace_s()
        if "TORCHELASTIC_RUN_ID" in os.environ and total_s > grace / 2 and not self._grace_warned:
            self._grace_warned = True
            self.announce(
                f"[lmpretrain] WARNING: a checkpoint takes {total_s:.0f} s, but on a stop signal the launcher "
                f"kills ranks {grace} s after SIGTERM: set TORCH_ELASTIC_SHUTDOWN_TIMEOUT={math.ceil(4 * total_s)} "
                "in the launch environment so the save on SIGTERM can finish"
            )

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the writer's threads and process group (a pending save that was not committed stays a
        .tmp-* directory, removed by the next save)."""
        self.files.close()

    def _failed(self, error: BaseException | None, tmp: Path, what: str) -> CheckpointError:
        if self.state.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is None:
            return CheckpointError(
                f"another rank failed to {what} in {self.dir}; nothing was saved "
                f"and the previous checkpoints are intact"
            )
        full = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
        fix = " (free space or raise the quota / file size limit, then resume with the same command)"
        err = CheckpointError(
            f"failed to {what} in {self.dir}: {type(error).__name__}: {error}; nothing "
            f"was saved and the previous checkpoints are intact{fix if full else ''}"
        )
        err.__cause__ = error
        return err

    def _commit(self, tmp: Path, final: Path, nonce: int) -> None:
        fsync_tree(tmp)  # DCP and DeepSpeed wrote some of these files
        manifest = {
            p.relative_to(tmp).as_posix(): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()
        }
        _write_text_synced(json.dumps(manifest, indent=1, sort_keys=True), tmp / MARKER_FILE)
        fsync_path(tmp)
        trash = None
        if final.exists():  # the same step saved again (e.g. a fresh run with overwrite): swap it out
            trash = self.dir / f".trash-{final.name}-{nonce:012x}"
            os.rename(final, trash)
        os.rename(tmp, final)
        fsync_path(self.dir)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    def prune(self) -> list[Path]:
        """Keep the newest ``keep_last`` valid checkpoints and the one with the lowest eval_loss."""
        if not self.state.is_main_process:
            return []
        valid = self.valid_checkpoints()
        keep = set(valid[: self.keep_last])
        scored = []
        for path in valid:
            loss = _read_meta(path).get("eval_loss")
            if isinstance(loss, (int, float)) and math.isfinite(loss):
                scored.append((loss, path))
        if scored:
            keep.add(min(scored, key=lambda lp: lp[0])[1])
        removed = []
        for path in valid:
            if path not in keep:
                try:
                    _remove_dir(path)
                    removed.append(path)
                except OSError as err:
                    logger.warning("could not delete old checkpoint %s: %s", path, err)
        return removed

    # -- loading --

    def metadata(self, path) -> dict:
        """What a checkpoint was saved with (step, world size, format, config, fingerprint), read from its
        marker and meta.json alone (no tensors, no other file: the files are checked by ``latest``,
        ``resolve_resume`` and ``load``)."""
        path = Path(path)
        problem = checkpoint_problem(path, checks=lambda name: False)
        if problem is not None:
            raise CheckpointError(f"cannot load {path}: {problem}")
        return _read_meta(path)

    def load(self, path, *, model, optimizer, states: dict, averages: dict | None = None) -> dict:
        """Restore ``model``, ``optimizer``, every object of ``states`` and the ``averages`` the checkpoint
        holds from ``path``; returns its metadata. A rank opens the shared files and the per-rank files its
        states need (its own when the world size is the one saved), whatever the world size. Every rank
        must call it."""
        path = Path(path)
        problem = self.files_problem(path)
        if problem is not None:
            raise CheckpointError(f"cannot load {path}: {problem}")
        meta = _read_meta(path)
        manifest = json.loads((path / MARKER_FILE).read_text(encoding="utf-8"))
        # The checkpoint's own format decides how to read it (a sharded one loads into any launch).
        files = self.files if meta["format"] == self.format else self._files(meta["format"])
        averages = averages or {}
        saved_averages = {k: v.state_dict() for k, v in averages.items() if k in meta.get("averages", [])}
        files.load(path, manifest, model, optimizer, saved_averages)
        for name in set(averages) - set(saved_averages):
            averages[name].restart()
        self.load_states(path, states, meta)
        return meta

    def load_states(self, path: Path, states: dict, meta: dict) -> None:
        """The part of ``load`` after the weights: every object of ``states`` from the shared states and the
        per-rank files its ``PerRank`` entries need (``saved_ranks``); ``meta`` is the checkpoint's."""
        shared = torch.load(path / STATES_FILE, map_location="cpu", weights_only=True)
        rank, saved_world = self.state.process_index, meta["world_size"]
        wanted = {r: e.saved_ranks(rank, saved_world) for r, e in states.items() if isinstance(e, PerRank)}
        saved_ranks = {
            r: torch.load(path / rank_file(r), map_location="cpu", weights_only=True)["states"]
            for r in sorted(set().union(*wanted.values()))
        }
        for name, obj in states.items():
            if isinstance(obj, PerRank):
                self._load_per_rank(path, name, obj, [saved_ranks[r].get(name) for r in wanted[name]])
            elif name in shared:
                obj.load_state_dict(shared[name])
            else:
                raise CheckpointError(
                    f"{path} has no state {name!r} (it has {sorted(shared)}): it was written by a version "
                    "of the recipe without it; resume it with that version, or start fresh"
                )

    def _load_per_rank(self, path: Path, name: str, entry: PerRank, saved: list) -> None:
        if any(s is None for s in saved):
            raise CheckpointError(f"{path} lacks the per-rank state {name!r} in some rank files")
        if entry.merge is not None:
            entry.obj.load_state_dict(entry.merge(saved))
        elif saved:
            entry.obj.load_state_dict(saved[0])
        else:
            logger.warning(
                "checkpoint %s has %r states for fewer ranks than this one; rank %d keeps its own",
                path,
                name,
                self.state.process_index,
            )


def _settle(future: Future) -> None:
    """Wait for a future whose outcome no longer matters (its error was superseded by another)."""
    try:
        future.result()
    except Exception:  # noqa: BLE001 - the first error is the one reported
        pass
