"""Run recipes/pretrain.py the way users do (python, or `accelerate launch` with a shipped launch
config) in real subprocesses, and read back what a run leaves on disk."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "pretrain.py"
SMOKE = ROOT / "configs" / "smoke.yaml"
ACCELERATE = Path(sys.executable).with_name("accelerate")
# Fast, quiet defaults for test runs: no sample generation unless a test asks for it.
QUICK = ["--eval.sample_tokens=0"]
# Runs compared across launches: float64 so that a real normalisation bug is not hidden by fp32
# summation-order noise, and each document's first target ignored so ignored tokens are uneven across ranks.
# Step 2 is also counted (logging.bytes_at_step): bytes sent per collective kind and held per rank.
EXACT = [
    *QUICK,
    "--train.max_steps=10",
    "--eval.every=5",
    "--checkpoint.every=0",
    "--eval.batches=3",
    "--train.param_dtype=float64",
    "--train.mask_cross_doc_targets=true",
    "--logging.wandb_mode=disabled",
    "--logging.bytes_at_step=2",  # what step 2 sent and held on rank 0, for the planner's checks (plan_check.py)
]


def one_thread_unless_set(args) -> list[str]:
    """`args` with `--run.threads=1` unless they set run.threads: the suite runs two tests at a time on two
    cores, where a second intra-op thread per process only spins in OpenMP's barriers (~20% more CPU for
    a 1-process run, no faster). A test about the default passes `--run.threads=0`."""
    args = [str(a) for a in args]
    return args if any(a.startswith("--run.threads=") for a in args) else [*args, "--run.threads=1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for_runs(extra: dict | None = None) -> dict:
    # No inherited W&B service (a test that called wandb.init exports WANDB_SERVICE) or key.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "WANDB_"))}
    env.update(
        WANDB_MODE="offline",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        WANDB_SILENT="true",
    )
    env.update(extra or {})
    return env


def command(
    out_dir,
    *overrides,
    launch: str | None = "cpu",
    launch_args=(),
    config=SMOKE,
    launcher=None,
    recipe=RECIPE,
) -> list[str]:
    """`launch=None` runs plain python; otherwise `accelerate launch --config_file configs/accelerate/<launch>.yaml`
    (`launcher=LAUNCHER`: the README's `python -m lmpretrain.launch`, same arguments); `recipe`: a fork's."""
    recipe = [str(recipe), str(config), f"--run.output_dir={out_dir}", *one_thread_unless_set(overrides)]
    if launch is None:
        return [sys.executable, *recipe]
    cfg = ROOT / "configs" / "accelerate" / f"{launch}.yaml"
    port = [] if "--main_process_port" in launch_args else ["--main_process_port", str(free_port())]
    return [
        *(launcher or [str(ACCELERATE), "launch"]),
        "--config_file",
        str(cfg),
        *port,
        *launch_args,
        *recipe,
    ]


LAUNCHER = [sys.executable, "-m", "lmpretrain.launch"]


@dataclass
class Run:
    out: Path
    returncode: int
    output: str

    def metrics(self) -> list[dict]:
        return read_metrics(self.out)

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["train/loss"] for r in self.metrics() if "train/loss" in r}

    def weights(self) -> dict[str, torch.Tensor]:
        return load_file(self.out / "final" / "model.safetensors")


def run(
    out_dir,
    *overrides,
    launch="cpu",
    launch_args=(),
    env=None,
    timeout=600,
    check=True,
    config=SMOKE,
    launcher=None,
    recipe=RECIPE,
    fork=True,
) -> Run:
    """One run of the recipe; `fork=False` (or a `launcher`) starts it as a new process tree, as a user's
    shell would, where the test is about the launch itself."""
    if fork and launcher is None:
        proc = start_forked(
            out_dir, *overrides, launch=launch, launch_args=launch_args, env=env, config=config, recipe=recipe
        )
        output = _wait(proc, timeout)
        return _result(Run(Path(out_dir), proc.returncode, output), check)
    cmd = command(
        out_dir,
        *overrides,
        launch=launch,
        launch_args=launch_args,
        config=config,
        launcher=launcher,
        recipe=recipe,
    )
    return run_command(cmd, out_dir, env=env, timeout=timeout, check=check)


def run_command(cmd: list[str], out_dir, *, env=None, timeout=600, check=True) -> Run:
    """Run `cmd` from the repository root in the test environment; its output is stdout and stderr."""
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env=env_for_runs(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return _result(Run(Path(out_dir), proc.returncode, proc.stdout), check)


def _result(result: Run, check: bool) -> Run:
    if check and result.returncode != 0:
        raise AssertionError(f"recipe exited {result.returncode}:\n{result.output[-6000:]}")
    return result


class ForkServer:
    """This pytest worker's tests/fork_server.py: runs start as forks of a process that has imported
    everything already (a launch costs ~1 CPU-s instead of ~15 per rank plus the launcher)."""

    def __init__(self):
        self.logs = Path(tempfile.mkdtemp(prefix="lmpretrain-forks-"))
        self.count, self.lock = 0, threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "fork_server.py")],
            cwd=ROOT,
            env=env_for_runs(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = self.proc.stdout.readline()
        assert ready.startswith('{"ready"'), f"the fork server did not start: {ready!r}"

    def start(
        self, launch, launch_args, recipe, args, env, log=None, ranks=None, rank_logs=None
    ) -> ForkedProcess:
        """`ranks`: `recipe` is a script, run once per environment given (fork_server.py's protocol)."""
        with self.lock:  # tests start runs from threads too: one request and its reply at a time
            self.count += 1
            request = {
                "launch": launch and str(ROOT / "configs" / "accelerate" / f"{launch}.yaml"),
                "launch_args": list(launch_args),
                "recipe": str(recipe),
                "args": list(args),
                "env": env_for_runs(env),
                "cwd": str(ROOT),
                "log": str(log or self.logs / f"{self.count}.log"),
                "ranks": [env_for_runs(r) for r in ranks or []],
                "rank_logs": [str(log) for log in rank_logs or []],
            }
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = json.loads(self.proc.stdout.readline())["pid"]
        return ForkedProcess(pid, Path(request["log"]))


class ForkedProcess:
    """A forked run, with what the tests use of subprocess.Popen (poll, wait, returncode). Signals go
    through kill_tree: to the run's whole process group, as a dying node or a scheduler does."""

    def __init__(self, pid: int, log: Path):
        self.pid, self.log, self.returncode = pid, log, None

    def poll(self) -> int | None:
        if self.returncode is None:
            rc = Path(f"{self.log}.rc")
            if rc.exists():
                status = json.loads(rc.read_text())
                global FORKED_CPU_S
                FORKED_CPU_S += status["cpu_s"]
                self.returncode = status["code"]
            elif not _alive(self.pid):  # killed before it could write its status
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.log), timeout)
            time.sleep(0.02)
        return self.returncode


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # the fork server reaps its forks at once: an ended run's pid is gone
    except ProcessLookupError:
        return False
    return True


# CPU seconds of every forked run so far (not this process's children: the fork server's), for the CPU log;
# also SLURM jobs' (count_cpu_s).
FORKED_CPU_S = 0.0


def count_cpu_s(seconds: float) -> None:
    """Count CPU time spent for a test outside this process's children (a SLURM job's) in the CPU log."""
    global FORKED_CPU_S
    FORKED_CPU_S += seconds


_SERVER: ForkServer | None = None


_STARTING = threading.Lock()


def _server() -> ForkServer:
    global _SERVER
    with _STARTING:
        if _SERVER is None or _SERVER.proc.poll() is not None:
            _SERVER = ForkServer()
        return _SERVER


def start_forked(
    out_dir, *overrides, launch="cpu", launch_args=(), env=None, config=SMOKE, recipe=RECIPE, log=None
) -> ForkedProcess:
    """`start()` as a fork of this worker's fork server instead of a new `accelerate launch`; `log`: a
    path (or an open file's) that receives the run's output."""
    if launch is not None and "--main_process_port" not in launch_args:
        launch_args = [*launch_args, "--main_process_port", str(free_port())]
    args = [str(config), f"--run.output_dir={out_dir}", *one_thread_unless_set(overrides)]
    return _server().start(launch, launch_args, recipe, args, env, getattr(log, "name", log))


def _wait(proc: ForkedProcess, timeout: float) -> str:
    """Wait for a forked run, killing it after `timeout` seconds; its output."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        tail = proc.log.read_text()[-3000:] if proc.log.exists() else ""
        raise AssertionError(f"the run did not end within {timeout} s; its output ended:\n{tail}") from None
    return proc.log.read_text() if proc.log.exists() else ""


def run_each(arg_lists: list[list[str]], timeout=600, env=None) -> list[str]:
    """`python recipes/pretrain.py ARGS` once per argument list (config first), one after the other, each
    forked from the fork server; returns each run's output and fails unless every run went through.
    `timeout` is per run."""
    outputs = []
    for args in arg_lists:
        proc = _server().start(None, [], RECIPE, one_thread_unless_set(args), env)
        outputs.append(_wait(proc, timeout))
        assert proc.returncode == 0, f"run {args} exited {proc.returncode}:\n{outputs[-1][-6000:]}"
    return outputs


def start(
    out_dir, *overrides, launch="cpu", launch_args=(), env=None, config=SMOKE, log=None
) -> subprocess.Popen:
    """Start a run in its own session, so signals sent to the test runner never reach it."""
    return subprocess.Popen(
        command(out_dir, *overrides, launch=launch, launch_args=launch_args, config=config),
        cwd=ROOT,
        env=env_for_runs(env),
        stdout=log or subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_for_step(proc: subprocess.Popen, out_dir, step: int, timeout: float = 300) -> int:
    """Poll metrics.jsonl until the run has logged `step`; returns the last logged step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = read_metrics(out_dir)
        if rows and rows[-1]["step"] >= step:
            return rows[-1]["step"]
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before step {step}")
        time.sleep(0.01)
    raise AssertionError(f"no step {step} within {timeout}s")


def kill_tree(proc: subprocess.Popen, sig=signal.SIGKILL) -> None:
    """Signal the launcher and every process under it at once, as a dying node or a scheduler's
    preemption does (torch elastic puts ranks in their own sessions, so a process-group kill misses them)."""
    if isinstance(proc, ForkedProcess):
        os.killpg(proc.pid, sig)  # its launcher fork and ranks are one process group
        return
    import psutil

    root = psutil.Process(proc.pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def read_metrics(out_dir) -> list[dict]:
    path = Path(out_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            break
    return rows


def file_sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest relative L2 difference over the parameter tensors of two state dicts."""
    assert a.keys() == b.keys()
    return max(
        ((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30)).item() for k in a
    )


def assert_close_runs(a: Run, b: Run, rel: float) -> None:
    """Every step's loss, gradient norm (which an optimizer's update may not show: Muon's and Adam's hide a
    gradient's scale) and held-out loss within `rel`, and the final weights."""
    import pytest

    for x, y in zip(a.metrics(), b.metrics(), strict=True):
        for key in ("train/loss", "train/grad_norm", "eval/loss"):
            assert x.get(key, 0.0) == pytest.approx(y.get(key, 0.0), rel=rel), (key, x["step"])
    assert rel_diff(a.weights(), b.weights()) < rel


def killed_then_resumed(out, args, launch: str, timeout: float, kill_at: int = 6) -> tuple[int, Run]:
    """A 10-step run (`args`, checkpoints every 4 steps) killed with SIGKILL once it has logged `kill_at`,
    then the same command again; returns the step it resumed from and the resumed run."""
    import re

    with open(Path(out).parent / f"{Path(out).name}.log", "w") as log:
        proc = start_forked(out, *args, launch=launch, log=log)
        wait_for_step(proc, out, kill_at, timeout=timeout)
        kill_tree(proc, signal.SIGKILL)
        proc.wait(timeout=60)
    killed_at = read_metrics(out)[-1]["step"]
    assert killed_at < 10, "the run finished before it could be killed"
    resumed = run(out, *args, launch=launch, timeout=timeout)
    resumed_at = int(re.search(r"resumed from \S+ at step (\d+)", resumed.output).group(1))
    assert resumed_at in (4, 8) and resumed_at <= killed_at
    return resumed_at, resumed


def assert_bit_identical(straight: Run, resumed: Run) -> None:
    """The same final weights file, byte for byte, and the same numbers at every one of 10 steps."""
    assert file_sha256(straight.out / "final" / "model.safetensors") == file_sha256(
        resumed.out / "final" / "model.safetensors"
    )
    assert [r["step"] for r in resumed.metrics()] == list(range(0, 11))
    for x, y in zip(straight.metrics(), resumed.metrics(), strict=True):
        keys = ("train/loss", "train/grad_norm", "eval/loss")
        assert [x.get(k) for k in keys] == [y.get(k) for k in keys], x["step"]


def launch_ranks(script, *args: str, world: int = 2, timeout: float = 120) -> list[str]:
    """Run `script` as ranks 0..world-1 of a torch.distributed group (env:// rendezvous on a free port), with
    the environment torchrun would give each, as forks of the fork server; returns each rank's output and
    fails if any rank fails (the others are then stopped, as torchrun does)."""
    port = str(free_port())
    logs = Path(tempfile.mkdtemp(prefix="lmpretrain-ranks-"))
    ranks = [
        {
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
        }
        for rank in range(world)
    ]
    rank_logs = [logs / f"rank-{rank}.log" for rank in range(world)]
    proc = _server().start(None, [], script, list(args), None, logs / "launcher.log", ranks, rank_logs)
    _wait(proc, timeout)
    outputs = [log.read_text() if log.exists() else "" for log in rank_logs]
    assert proc.returncode == 0, f"a rank exited {proc.returncode}:\n" + "\n".join(outputs)
    return outputs
