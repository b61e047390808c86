"""Experiment tracking: W&B through accelerate's trackers and ``metrics.jsonl``.

One :class:`Tracker` per run. The main process writes ``<output_dir>/metrics.jsonl`` (one JSON object
per optimizer step, the same keys as W&B) and ``samples.jsonl``, and owns the W&B run; other ranks do
nothing. W&B files go under ``<output_dir>/wandb/`` (offline runs in ``offline-run-*/``).

Resume: pass the run id stored in the checkpoint and the checkpoint's step. The same W&B run is
continued (``resume="allow"``); ``metrics.jsonl`` keeps only rows up to the checkpoint (later rows are
redone), and steps W&B has already received are not sent again, so W&B steps never go backwards or
repeat.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import netrc
import os
import re
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from lmpretrain.observe.console import as_scalar

EVAL_BLOCKS = "eval_blocks.jsonl"  # each evaluation's per-block losses (observe/evaluation.py)

logger = logging.getLogger(__name__)

WANDB_MODES = ("online", "offline", "disabled")
SAMPLES_TABLE_KEY = "eval/samples"
REDACTED = "<redacted>"

# --------------------------------------------------------------------------------------------
# Secrets
# --------------------------------------------------------------------------------------------

# A key is secret when one of its "_"-separated words is one of these (hf_token, api_key, ...).
_SECRET_KEY = re.compile(
    r"(^|_)(api_?key|apikey|token|auth_?token|access_?token|secret|secret_?key|password|passwd|"
    r"credentials?|private_?key|access_?key)($|_)"
)
# ... but not ids/counts of tokens, nor a tokenizer's special tokens, which are plain strings.
_NOT_SECRET_KEY = re.compile(
    r"(_ids?|_len|_length|_count|_size|_index)$|^(bos|eos|pad|unk|sep|cls|mask)_token$"
)
_SECRET_ENV = re.compile(r"(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)


def is_secret_key(key: str) -> bool:
    """Whether a config key name looks like it holds a credential."""
    k = key.lower().replace("-", "_").replace(".", "_")
    return bool(_SECRET_KEY.search(k)) and not _NOT_SECRET_KEY.search(k)


def secret_env_values() -> list[str]:
    """Values (>= 8 chars) of environment variables whose names look secret, WANDB_API_KEY first."""
    values = [os.environ.get("WANDB_API_KEY", "")]
    values += [v for k, v in os.environ.items() if _SECRET_ENV.search(k)]
    return sorted({v for v in values if len(v) >= 8}, key=len, reverse=True)


def scrub_secrets(obj: Any, secrets: list[str] | None = None) -> Any:
    """A copy of ``obj`` with secret-looking keys and any secret environment value redacted."""
    secrets = secret_env_values() if secrets is None else secrets
    if isinstance(obj, Mapping):
        return {
            k: REDACTED
            if is_secret_key(str(k)) and obj[k] not in (None, "")
            else scrub_secrets(obj[k], secrets)
            for k in obj
        }
    if isinstance(obj, (list, tuple)):
        return [scrub_secrets(v, secrets) for v in obj]
    if isinstance(obj, str):
        for s in secrets:
            if s in obj:
                obj = obj.replace(s, REDACTED)
    return obj


def jsonable(obj: Any) -> Any:
    """Plain JSON types for a config tree (dataclasses, paths, dtypes, enums, numpy/torch scalars)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, enum.Enum):
        return jsonable(obj.value)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        try:
            return obj.item()
        except (ValueError, RuntimeError):
            pass
    return str(obj)


# --------------------------------------------------------------------------------------------
# W&B mode
# --------------------------------------------------------------------------------------------


def _check_mode(mode: str) -> None:
    if mode not in WANDB_MODES:
        raise ValueError(f"logging.wandb_mode must be one of {WANDB_MODES}, got {mode!r}")


def wandb_log_with(mode: str) -> list[str] | None:
    """``log_with`` for ``Accelerator``: ``["wandb"]`` unless W&B is disabled (config or WANDB_MODE)."""
    _check_mode(mode)
    if mode == "disabled" or os.environ.get("WANDB_MODE") == "disabled":
        return None
    return ["wandb"]


def wandb_base_url() -> str:
    """The W&B server from W&B's own settings (env WANDB_BASE_URL, settings files, default)."""
    if os.environ.get("WANDB_BASE_URL"):
        return os.environ["WANDB_BASE_URL"]
    try:
        import wandb

        return str(wandb.setup().settings.base_url)
    except Exception:  # any failure here only means "use the default"
        return "https://api.wandb.ai"


def has_wandb_credentials(base_url: str | None = None) -> bool:
    """An API key in WANDB_API_KEY, an identity token file, or a .netrc entry for the W&B host."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(base_url or wandb_base_url()).netloc
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        entries = netrc.netrc(path)
    except (OSError, netrc.NetrcParseError):
        return False
    for machine in {host, "api.wandb.ai"}:
        auth = entries.authenticators(machine) if machine else None
        if auth and auth[2]:
            return True
    return False


def can_reach(url: str, timeout: float = 2.0) -> bool:
    """TCP connect to the URL's host within ``timeout`` seconds, DNS included (thread-bounded)."""
    parts = urlsplit(url)
    host = parts.hostname
    if not host:
        return False
    port = parts.port or (443 if parts.scheme == "https" else 80)
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)  # getaddrinfo ignores socket timeouts; the join bounds it
    return bool(result and result[0])


def resolve_wandb_mode(mode: str, probe_timeout: float = 2.0) -> str:
    """The W&B mode a run really uses: ``online`` drops to ``offline`` without key or network."""
    _check_mode(mode)
    env_mode = os.environ.get("WANDB_MODE")
    if mode == "disabled" or env_mode == "disabled":
        return "disabled"
    if mode == "offline":
        return "offline"
    reason = None
    if env_mode in ("offline", "dryrun"):
        reason = f"WANDB_MODE={env_mode} is set in the environment"
    elif not has_wandb_credentials():
        reason = "no W&B API key (set WANDB_API_KEY or run `wandb login`)"
    else:
        url = wandb_base_url()
        if not can_reach(url, probe_timeout):
            reason = f"cannot reach {url} within {probe_timeout:g} s"
    if reason:
        logger.warning(
            "W&B: %s -> logging offline; sync later with `wandb sync <output_dir>/wandb/offline-run-*`",
            reason,
        )
        return "offline"
    return "online"


# --------------------------------------------------------------------------------------------
# jsonl files
# --------------------------------------------------------------------------------------------


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Rows of a jsonl file; a torn last line (a crash mid-write) is skipped with a warning."""
    rows = []
    path = Path(path)
    if not path.exists():
        return rows
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                logger.warning("%s: ignoring a torn last line", path)
            else:
                raise ValueError(f"{path}:{i + 1} is not valid JSON") from None
    return rows


def _write_jsonl_atomic(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# Tracker
# --------------------------------------------------------------------------------------------


def _histogram(value):
    """A list of numbers (e.g. moe/load/layer_N: each expert's share of the tokens) goes to W&B as a histogram
    whose bins are its positions; metrics.jsonl keeps the list."""
    if not isinstance(value, list):
        return value
    import wandb

    return wandb.Histogram(np_histogram=(value, list(range(len(value) + 1))))


class Tracker:
    """W&B (through accelerate) + ``metrics.jsonl`` + ``samples.jsonl`` for one run; see module doc.

    Construct it on every rank (the run id is broadcast from the main process, a collective); only
    the main process writes files or talks to W&B. ``mode`` is the configured mode; ``self.mode`` is
    the one really used on the main process (``online`` may fall back to ``offline``).
    """

    def __init__(
        self,
        accelerator: Any,
        *,
        output_dir: str | os.PathLike,
        project: str,
        mode: str,
        run_name: str | None,
        group: str | None,
        run_config: dict,
        run_id: str | None = None,
        resume_step: int | None = None,
    ) -> None:
        _check_mode(mode)
        self.accelerator = accelerator
        self.output_dir = Path(output_dir)
        self.metrics_path = self.output_dir / "metrics.jsonl"
        self.samples_path = self.output_dir / "samples.jsonl"
        self.mode = "disabled"  # the mode really used, set below on the main process
        self._is_main = accelerator.is_main_process
        self._run = None
        self._run_id = run_id
        self._wandb_sent_upto: int | None = None  # W&B already holds steps <= this
        self._metrics_file = None
        self._last: tuple[int, dict, int] | None = None  # (step, row, byte offset) of the last line
        self._finished = False
        self._secrets = secret_env_values()  # never written anywhere, even inside a logged string
        if self._is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            old_max_step = self._prepare_file(self.metrics_path, resume_step)
            if run_id is not None:  # continuing a W&B run that already holds steps <= old_max_step
                self._wandb_sent_upto = old_max_step
            self._prepare_file(self.samples_path, resume_step)
            self._prepare_file(self.output_dir / EVAL_BLOCKS, resume_step)  # the Evaluator appends to it
            self._open_metrics()
            self.mode = resolve_wandb_mode(mode)
            if self.mode != "disabled":
                self._start_wandb(project, run_name, group, run_config, run_id)
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            self._run_id = broadcast_object_list([self._run_id], from_process=0)[0]

    @classmethod
    def for_run(
        cls, accelerator: Any, cfg: Any, *, facts: dict, run_id: str | None, resume_step: int | None
    ) -> Tracker:
        """The tracker of a recipe run: W&B project/mode from `cfg.logging`, name and group from the
        config file and output dir; the run config is the whole config plus `facts` (what really
        runs, and what made the run: run/provenance.py)."""
        out, recipe = Path(cfg.run.output_dir), Path(cfg.config_path or "run").stem
        return cls(
            accelerator,
            output_dir=out,
            project=cfg.logging.wandb_project,
            mode=cfg.logging.wandb_mode,
            run_name=cfg.run.name or f"{recipe}-{out.name}",
            group=cfg.run.group or recipe,
            run_config={**cfg.to_dict(), **facts},
            run_id=run_id,
            resume_step=resume_step,
        )

    @property
    def run_id(self) -> str | None:
        """W&B run id to store in checkpoints (None when W&B is disabled)."""
        return self._run_id

    # -- set-up ----------------------------------------------------------------------------------

    def _prepare_file(self, path: Path, resume_step: int | None) -> int | None:
        """Keep rows with step <= resume_step (atomically); return the old file's highest step."""
        rows = read_jsonl(path)
        if not rows:
            return None
        if resume_step is None:
            old = path.with_name(path.name + ".prev")
            os.replace(path, old)
            logger.warning("%s existed but this is a fresh run: moved it to %s", path, old)
            return None
        _write_jsonl_atomic(path, [r for r in rows if r["step"] <= resume_step])
        return max(r["step"] for r in rows)

    def _open_metrics(self) -> None:
        self._metrics_file = open(self.metrics_path, "ab")
        rows = read_jsonl(self.metrics_path)
        if rows:  # resuming: a log at the step of the last kept row merges into that row
            data = self.metrics_path.read_bytes()
            self._last = (rows[-1]["step"], rows[-1], data.rfind(b"\n", 0, len(data) - 1) + 1)

    def _start_wandb(self, project, run_name, group, run_config, run_id) -> None:
        if not any(
            str(t) == "wandb" or getattr(t, "name", None) == "wandb" for t in self.accelerator.log_with
        ):
            raise ValueError(
                "W&B mode is not 'disabled' but the Accelerator was built without W&B: create it with "
                "Accelerator(log_with=lmpretrain.observe.tracking.wandb_log_with(mode))"
            )
        init = {"dir": str(self.output_dir), "mode": self.mode, "name": run_name, "group": group}
        if run_id is not None:
            init.update(id=run_id, resume="allow")
        config = scrub_secrets(jsonable(run_config), self._secrets)
        self.accelerator.init_trackers(project, config=config, init_kwargs={"wandb": init})
        self._run = self.accelerator.get_tracker("wandb", unwrap=True)
        self._run_id = self._run.id
        # Tokens seen as a second x-axis for every metric family (step stays the default one).
        self._run.define_metric("train/tokens_seen")
        for family in ("train", "eval", "perf"):
            self._run.define_metric(f"{family}/*", step_metric="train/tokens_seen")
        self._run.define_metric("eval/loss", step_metric="train/tokens_seen", summary="min")

    # -- logging ---------------------------------------------------------------------------------

    def _to_wandb(self, step: int) -> bool:
        return self._run is not None and (self._wandb_sent_upto is None or step > self._wandb_sent_upto)

    def log(self, metrics: dict, step: int) -> None:
        """One row per step in metrics.jsonl (same-step calls merge) and the same keys to W&B."""
        if not self._is_main:
            return
        step = int(step)
        values = {k: scrub_secrets(as_scalar(v), self._secrets) for k, v in metrics.items()}
        f = self._metrics_file
        if self._last is not None and step < self._last[0]:
            raise ValueError(f"metrics step went backwards: {step} after {self._last[0]}")
        if self._last is not None and step == self._last[0]:
            row, offset = {**self._last[1], **values, "_timestamp": time.time()}, self._last[2]
            f.truncate(offset)
        else:
            row, offset = {"step": step, **values, "_timestamp": time.time()}, f.seek(0, os.SEEK_END)
        f.write((json.dumps(row, default=str) + "\n").encode())
        f.flush()
        self._last = (step, row, offset)
        if self._to_wandb(step):
            self._send(values, step)

    def _send(self, values: dict, step: int) -> None:
        """W&B is a mirror of metrics.jsonl: if its service dies (e.g. the scheduler's SIGTERM reached
        it too), say so once and keep training with metrics.jsonl rather than crash the run."""
        try:
            self.accelerator.log({k: _histogram(v) for k, v in values.items()}, step=step)
        except Exception as err:  # noqa: BLE001 - any W&B failure must not stop training
            logger.warning(
                "W&B logging failed at step %d (%s: %s); continuing with %s only",
                step,
                type(err).__name__,
                err,
                self.metrics_path,
            )
            self._run = None

    def log_samples(self, step: int, rows: list[tuple[str, str]]) -> None:
        """Sample generations: a W&B Table (step, prompt, generation) and lines in samples.jsonl."""
        if not self._is_main:
            return
        rows = [scrub_secrets((str(p), str(g)), self._secrets) for p, g in rows]
        with open(self.samples_path, "a", encoding="utf-8") as f:
            for prompt, generation in rows:
                f.write(json.dumps({"step": int(step), "prompt": prompt, "generation": generation}) + "\n")
        if self._to_wandb(step):
            import wandb

            table = wandb.Table(
                columns=["step", "prompt", "generation"], data=[[int(step), p, g] for p, g in rows]
            )
            self._send({SAMPLES_TABLE_KEY: table}, int(step))

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, *_) -> None:
        """The W&B run ends failed (exit code 1) when the run ends on an exception."""
        self.finish(exit_code=1 if exc_type else 0)

    def finish(self, exit_code: int | None = None) -> None:
        """Close the files and finish the W&B run (idempotent; does not end accelerate's training)."""
        if self._finished:
            return
        self._finished = True
        if self._metrics_file is not None:
            self._metrics_file.close()
        if self._run is not None:
            tracker = self.accelerator.get_tracker("wandb")
            try:
                self._run.finish(exit_code=exit_code)
            except Exception as err:  # noqa: BLE001 - the service may be gone (signalled with the job)
                logger.warning(
                    "W&B finish failed (%s: %s); %s is complete", type(err).__name__, err, self.metrics_path
                )
            # accelerator.end_training() would finish it again; it is done.
            self.accelerator.trackers.remove(tracker)
            self._run = None
