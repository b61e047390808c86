"""Atomic, per-rank, valid-only checkpoints; resume discovery; retention.

A checkpoint is ``<output_dir>/checkpoints/step-NNNNNNNN/`` holding:

* ``model.safetensors``  full (unsharded) weights; tied aliases are stored once and re-created on load
* ``optimizer.pt``       full optimizer state keyed by parameter names (survives DDP/FSDP wrapping)
* ``deepspeed/``         instead of ``optimizer.pt`` under DeepSpeed: the engine's own checkpoint (its
                         ZeRO optimizer partitions, one file per rank, fp32 master weights, loss scaler)
* ``rank-00000.pt`` ...  per rank: RNG states (python, numpy, torch, CUDA) and the data-pipeline state
* ``trainer_state.json`` counters, scheduler, scaler, world size, resolved config, fingerprint
* ``COMPLETE``           JSON manifest ``{file: size_in_bytes}`` of every other file, written last

Write protocol (every rank calls ``save``): main creates ``checkpoints/.tmp-step-N-<nonce>/``; every
rank writes and fsyncs its files there; all ranks agree nothing failed; main writes ``COMPLETE``,
fsyncs it and the directory, renames the directory to ``step-N`` and fsyncs ``checkpoints/``. The
rename is the commit: a directory named ``step-N`` appears complete, with its marker, or not at all.
The marker and its sizes are a second defence for copies made by other tools and truncated files.
A crash at any point leaves the older checkpoints untouched; leftover ``.tmp-*`` directories are
removed by the next save. Every ``torch.load`` here uses ``weights_only=True`` (DeepSpeed's loader,
which reads only the ``deepspeed/`` directory it wrote, unpickles its own objects).
"""

import json
import logging
import math
import os
import re
import shutil
from pathlib import Path

import safetensors.torch
import torch
from accelerate import PartialState
from accelerate.utils import DistributedType
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lmpretrain.distributed import any_rank, broadcast_int
from lmpretrain.errors import CheckpointError
from lmpretrain.rng import capture_rng_state, restore_rng_state

logger = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
DEEPSPEED_DIR = "deepspeed"
TRAINER_STATE_FILE = "trainer_state.json"
MARKER_FILE = "COMPLETE"
STEP_DIR = re.compile(r"^step-(\d{8,})$")
RANK_FILE = re.compile(r"^rank-(\d{5})\.pt$")
_ALIASES_KEY = "lmpretrain.tied_aliases"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


# ---- small helpers ---------------------------------------------------------------------------------


def _fsync(path: Path) -> None:
    """Flush a file's or a directory's entries to disk (a directory fsync makes renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_save_synced(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_text_synced(text: str, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and the directories themselves (for files another library wrote)."""
    for p in sorted(path.rglob("*")):
        _fsync(p)
    _fsync(path)


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


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def merge_data_states(states: list[dict]) -> dict:
    """Merge the ranks' data states: ``streams`` by stream id; any other key must agree across ranks."""
    merged: dict = {}
    for rank, st in enumerate(states):
        for key, value in st.items():
            if key == "streams":
                streams = merged.setdefault("streams", {})
                for sid, s in value.items():
                    if sid in streams and not _same(streams[sid], s):
                        raise CheckpointError(
                            f"data stream {sid!r} has different states in two rank files "
                            f"(second one: {rank_file(rank)}); the checkpoint is inconsistent"
                        )
                    streams[sid] = s
            elif key in merged and not _same(merged[key], value):
                raise CheckpointError(
                    f"data state key {key!r} differs between rank files ({rank_file(rank)}); "
                    f"only 'streams' is merged across ranks"
                )
            else:
                merged[key] = value
    return merged


def _split_tied(state_dict: dict) -> tuple[dict, dict]:
    """Drop aliases of tensors already present (tied weights): safetensors refuses shared storage."""
    unique, aliases, seen = {}, {}, {}
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(
                f"model state entry {name!r} is a {type(t).__name__}, not a tensor; "
                f"model.safetensors can only hold tensors"
            )
        key = None
        if t.numel():
            key = (
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                tuple(t.stride()),
                t.dtype,
            )
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        # safetensors needs contiguous tensors; this copies only the (rare) non-contiguous ones.
        unique[name] = t if t.is_contiguous() else t.contiguous()
    return unique, aliases


# ---- validation --------------------------------------------------------------------------------------


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a loadable checkpoint, or None when it is (marker, manifest sizes, step)."""
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
    for required in (MODEL_FILE, TRAINER_STATE_FILE, rank_file(0)):
        if required not in manifest:
            return f"manifest lacks {required}"
    if OPTIMIZER_FILE not in manifest and not any(name.startswith(f"{DEEPSPEED_DIR}/") for name in manifest):
        return f"manifest lacks {OPTIMIZER_FILE} (or a {DEEPSPEED_DIR}/ optimizer)"
    ranks = sorted(int(m.group(1)) for m in map(RANK_FILE.match, manifest) if m)
    if ranks != list(range(len(ranks))):
        return f"manifest has rank files {ranks}, not 0..{len(ranks) - 1}"
    for name, size in manifest.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        actual = f.stat().st_size
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size} (truncated or overwritten)"
    try:
        trainer_state = json.loads((path / TRAINER_STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return f"unreadable {TRAINER_STATE_FILE} ({err})"
    if trainer_state.get("step") != int(match.group(1)):
        return (
            f"{TRAINER_STATE_FILE} says step {trainer_state.get('step')}, the directory name {match.group(1)}"
        )
    world_size = trainer_state.get("world_size")
    if world_size is not None and world_size != len(ranks):
        return f"{len(ranks)} rank files for world size {world_size}"
    return None


def _read_trainer_state(path: Path) -> dict:
    return json.loads((path / TRAINER_STATE_FILE).read_text(encoding="utf-8"))


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


# ---- the checkpointer ------------------------------------------------------------------------------------


class Checkpointer:
    """Saves, finds, loads and prunes the checkpoints of one output dir (all ranks call save/load)."""

    def __init__(self, output_dir, accelerator=None, keep_last: int = 2):
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

    # -- discovery --

    def _step_dirs(self) -> list[Path]:
        """step-* directories, newest first (by the number in the name: only for ordering)."""
        if not self.dir.is_dir():
            return []
        dirs = [p for p in self.dir.iterdir() if STEP_DIR.match(p.name) and p.is_dir()]
        return sorted(dirs, key=lambda p: int(STEP_DIR.match(p.name).group(1)), reverse=True)

    def valid_checkpoints(self) -> list[Path]:
        """Every loadable checkpoint, newest first."""
        return [p for p in self._step_dirs() if checkpoint_problem(p) is None]

    def latest(self) -> Path | None:
        """The newest valid checkpoint; newer invalid ones are skipped with a warning naming them."""
        for path in self._step_dirs():
            problem = checkpoint_problem(path)
            if problem is None:
                return path
            if self.state.is_main_process:
                logger.warning("ignoring checkpoint %s: %s; falling back to an older one", path, problem)
        return None

    def resolve_resume(self, resume: str, overwrite: bool) -> Path | None:
        """``auto``: the newest valid checkpoint or None; ``never``: None (refusing existing
        checkpoints unless ``overwrite``, which deletes them); otherwise the checkpoint at that path."""
        if resume == "auto":
            return self.latest()
        if resume == "never":
            existing = self._step_dirs()
            if existing and not overwrite:
                raise CheckpointError(
                    f"run.resume=never but {self.dir} already has {len(existing)} checkpoint(s) "
                    f"(newest {existing[0].name}). Resume them with --run.resume=auto, use another output_dir, "
                    f"or pass --run.overwrite=true to delete them and start fresh."
                )
            if existing and self.state.is_main_process:
                # Left in place, they would be mixed with the new run's (auto-resume could pick them).
                logger.warning(
                    "run.overwrite=true: deleting %d old checkpoint(s) in %s", len(existing), self.dir
                )
                for path in existing:
                    _remove_dir(path)
            self.state.wait_for_everyone()
            return None
        path = Path(resume)
        problem = checkpoint_problem(path)
        if problem is not None:
            hint = ""
            if (path / "checkpoints").is_dir():
                hint = f" (it looks like an output dir: point at one of {path / 'checkpoints'}/step-*)"
            raise CheckpointError(f"run.resume={resume!r} is not a loadable checkpoint: {problem}{hint}")
        return path

    # -- saving --

    def _clean_leftovers(self) -> None:
        for p in self.dir.iterdir():
            if p.name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(p, ignore_errors=True)

    def save(self, step: int, *, model, optimizer, data_state: dict, trainer_state: dict) -> Path:
        """Write checkpoint ``step`` atomically, then prune old ones. Every rank must call it."""
        rng = capture_rng_state()  # first: nothing below may consume randomness, but be sure
        st = self.state
        final = self.dir / step_dir_name(step)
        # Errors are collected, agreed on by all ranks, then raised everywhere: a rank that raised
        # alone would leave the others waiting forever in the next collective.
        error: BaseException | None = None
        try:
            if trainer_state.get("step", step) != step:
                raise ValueError(f"trainer_state['step'] is {trainer_state['step']} but saving step {step}")
            _check_plain(data_state, "data_state")
            trainer_json = json.dumps({**trainer_state, "step": step}, indent=2, sort_keys=True)
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
            error = self._try(error, tmp.mkdir)
        if any_rank(error is not None, st):  # also the barrier: tmp exists before anyone writes
            raise self._failed(error, tmp, f"start {final.name}")

        # Collective calls happen on every rank whatever happened before, so a write error on one
        # rank cannot leave the others waiting inside a gather.
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # full on main, empty elsewhere (sharded); a DeepSpeed engine's module holds whole weights (ZeRO 1/2)
        weights = get_model_state_dict(model.module if self.deepspeed else model, options=options)
        if st.is_main_process:
            error = self._try(error, self._write_model, weights, tmp / MODEL_FILE)
        del weights
        if self.deepspeed:
            # A collective (every rank writes its own partition): called on every rank whatever failed before.
            try:
                model.save_checkpoint(str(tmp), tag=DEEPSPEED_DIR, save_latest=False)
            except Exception as err:  # noqa: BLE001 - re-raised by _failed after the ranks agree
                error = error or err
            if st.is_main_process:
                error = self._try(error, _fsync_tree, tmp)
        else:
            optim_state = self._optimizer_state(model, optimizer, options)
            if st.is_main_process:
                error = self._try(error, _torch_save_synced, optim_state, tmp / OPTIMIZER_FILE)
            del optim_state
        if st.is_main_process:
            error = self._try(error, _write_text_synced, trainer_json, tmp / TRAINER_STATE_FILE)
        rank_state = {
            "rank": st.process_index,
            "world_size": st.num_processes,
            "rng": rng,
            "data": data_state,
        }
        error = self._try(error, _torch_save_synced, rank_state, tmp / rank_file(st.process_index))
        if any_rank(error is not None, st):
            raise self._failed(error, tmp, f"write {final.name}")

        if st.is_main_process:
            error = self._try(None, self._commit, tmp, final, nonce)
        if any_rank(error is not None, st):
            raise self._failed(error, tmp, f"commit {final.name}")
        if st.is_main_process:
            self.prune()
        return final

    @staticmethod
    def _try(previous: BaseException | None, fn, *args) -> BaseException | None:
        """Run fn unless an earlier step failed; return the first error (raised later, on every rank)."""
        if previous is not None:
            return previous
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 - re-raised by _failed after the ranks agree
            return err
        return None

    def _failed(self, error: BaseException | None, tmp: Path, what: str) -> CheckpointError:
        if self.state.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is None:
            return CheckpointError(
                f"another rank failed to {what} in {self.dir}; nothing was saved "
                f"and the previous checkpoints are intact"
            )
        err = CheckpointError(
            f"failed to {what} in {self.dir}: {type(error).__name__}: {error}; nothing "
            f"was saved and the previous checkpoints are intact"
        )
        err.__cause__ = error
        return err

    @staticmethod
    def _write_model(weights: dict, path: Path) -> None:
        tensors, aliases = _split_tied(weights)
        safetensors.torch.save_file(
            tensors, path, metadata={"format": "pt", _ALIASES_KEY: json.dumps(aliases)}
        )
        _fsync(path)

    @staticmethod
    def _optimizer_state(model, optimizer, options) -> dict:
        if not optimizer.state:
            # get_optimizer_state_dict would initialise an unstepped optimizer with a fake step
            # (moments 0, step 1), changing the live run; save the hyperparameters only.
            return {
                "state": {},
                "param_groups": [
                    {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
                ],
            }
        return get_optimizer_state_dict(model, optimizer, options=options)

    def _commit(self, tmp: Path, final: Path, nonce: int) -> None:
        manifest = {
            p.relative_to(tmp).as_posix(): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()
        }
        _write_text_synced(json.dumps(manifest, indent=1, sort_keys=True), tmp / MARKER_FILE)
        _fsync(tmp)
        trash = None
        if final.exists():  # the same step saved again (e.g. a fresh run with overwrite): swap it out
            trash = self.dir / f".trash-{final.name}-{nonce:012x}"
            os.rename(final, trash)
        os.rename(tmp, final)
        _fsync(self.dir)
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
            loss = _read_trainer_state(path).get("eval_loss")
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

    def trainer_state(self, path) -> dict:
        """The counters, config and fingerprint a checkpoint was saved with (cheap: no tensors read)."""
        path = Path(path)
        problem = checkpoint_problem(path)
        if problem is not None:
            raise CheckpointError(f"cannot load {path}: {problem}")
        return _read_trainer_state(path)

    def load(self, path, *, model, optimizer) -> tuple[dict, dict]:
        """Restore weights, optimizer and this rank's RNG from ``path``. Returns (data state merged
        over all ranks' files, trainer_state). Every rank must call it."""
        path = Path(path)
        trainer_state = self.trainer_state(path)
        st = self.state
        manifest = json.loads((path / MARKER_FILE).read_text(encoding="utf-8"))
        names = sorted(n for n in manifest if RANK_FILE.match(n))
        if self.deepspeed:
            self._load_deepspeed(path, manifest, model, ranks=len(names))
        else:
            self._load_full(path, manifest, model, optimizer)

        rank_states = [torch.load(path / n, map_location="cpu", weights_only=True) for n in names]
        data_state = merge_data_states([r["data"] for r in rank_states])
        if st.process_index < len(rank_states):
            restore_rng_state(rank_states[st.process_index]["rng"])  # last: loading must not move RNGs
        else:
            logger.warning(
                "checkpoint %s has RNG states for %d ranks; rank %d keeps its seeded RNG",
                path,
                len(rank_states),
                st.process_index,
            )
        return data_state, trainer_state

    def _load_deepspeed(self, path: Path, manifest: dict, model, ranks: int) -> None:
        if OPTIMIZER_FILE in manifest:
            raise CheckpointError(
                f"{path} was written without DeepSpeed (full {OPTIMIZER_FILE}); DeepSpeed cannot "
                f"load it: resume it with the launch config that wrote it"
            )
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

    def _load_full(self, path: Path, manifest: dict, model, optimizer) -> None:
        if OPTIMIZER_FILE not in manifest:
            raise CheckpointError(
                f"{path} was written by a DeepSpeed run (its optimizer state is partitioned in "
                f"{DEEPSPEED_DIR}/): resume it under DeepSpeed with the same number of processes"
            )
        weights = safetensors.torch.load_file(path / MODEL_FILE, device="cpu")
        with safetensors.safe_open(path / MODEL_FILE, framework="pt") as f:
            aliases = json.loads((f.metadata() or {}).get(_ALIASES_KEY, "{}"))
        for alias, name in aliases.items():
            weights[alias] = weights[name]
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
        del weights

        optim_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        groups = optim_state["param_groups"]
        if len(groups) != len(optimizer.param_groups):
            raise CheckpointError(
                f"{path / OPTIMIZER_FILE} has {len(groups)} parameter groups, "
                f"the optimizer has {len(optimizer.param_groups)}"
            )
        if optim_state["state"]:
            # torch's full-state loader fails with a bare KeyError on group keys the live optimizer
            # lacks (e.g. 'initial_lr' when the scheduler is built after loading); the load
            # overwrites every group value anyway, so add the missing ones first.
            for live, saved in zip(optimizer.param_groups, groups, strict=True):
                for key, value in saved.items():
                    live.setdefault(key, value)
            set_optimizer_state_dict(
                model, optimizer, optim_state, options=StateDictOptions(full_state_dict=True)
            )
            for live, saved in zip(optimizer.param_groups, groups, strict=True):  # it turns tuples into lists
                for key, value in saved.items():
                    if isinstance(value, tuple) and isinstance(live.get(key), list):
                        live[key] = tuple(live[key])
        else:
            optimizer.state.clear()
            for live, saved in zip(optimizer.param_groups, groups, strict=True):
                live.update(saved)
        del optim_state
