"""Start recipe runs as forks of one process that has already imported everything they import.

A tiny test run spends most of its CPU starting up: the interpreter, torch, transformers, accelerate, wandb
and the model's module (~10 CPU-s a process), and `accelerate launch` imports most of them once more
(~5 CPU-s) to start the ranks. This server imports them once per pytest worker; each run is then a fork
per rank that executes the recipe file as `__main__`, exactly as `python recipes/pretrain.py ARGS` would,
in the environment accelerate's own launcher would give it: accelerate parses the launch config and
computes that environment (`accelerate.utils.launch.prepare_*`), and the fork adds what torch elastic sets
for each rank (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...). Tests about the launchers themselves
(restarts, signals, `python -m lmpretrain.launch`) start them for real (tests/recipe_runner.py).

Protocol (one JSON object per line on stdin, one reply per line on stdout):
    {"launch": CONFIG_FILE or null, "launch_args": [...], "recipe": PATH, "args": [...], "env": {...},
     "cwd": DIR, "log": PATH, "ranks": [{...}, ...] (optional), "rank_logs": [PATH, ...] (optional)}
      ->  {"pid": PID}
The run's ranks write stdout and stderr to `log`; when they are done, the launcher fork writes its exit
status (0, or 1 when a rank failed, as `accelerate launch` exits; a plain-python run's own status) to
`log + ".rc"`. Killing the process group PID ends the run. `ranks` (with `"launch": null`): a script
run as one rank per environment given, as torchrun would start it (`recipe` is then any script; each
rank writes to its own `rank_logs` entry; the status is the first failed rank's, else 0).
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import runpy
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# How long the ranks that are still running get after one failed, before SIGKILL (torch elastic's default).
SHUTDOWN_GRACE_S = 30


def preload() -> None:
    """Import what runs import, without running anything (a thread pool started here would not survive
    the fork: the children would wait on it forever)."""
    import importlib

    runpy.run_path(str(ROOT / "recipes" / "pretrain.py"), run_name="preloaded_recipe")
    for module in (
        "accelerate.commands.launch",
        "wandb",
        "wandb.apis.public",  # what wandb.init and finish import (pandas and pyarrow among them)
        "wandb.sdk.launch.inputs.internal",
        "torch.utils.serialization",
        "pandas",
        "pyarrow.compute",
        "transformers.models.llama.modeling_llama",
        "transformers.models.gpt2.modeling_gpt2",
        "torch.distributed.fsdp",
        "torch.distributed.checkpoint",
    ):
        importlib.import_module(module)


def rank_environments(request: dict) -> tuple[list[dict], bool]:
    """Each rank's environment, and whether the launch is accelerate's (exit status 0/1) or plain python."""
    env = dict(request["env"])
    if request["launch"] is None:
        return [env], False
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    parser = launch_command_parser()
    args = parser.parse_args(
        ["--config_file", request["launch"], *request["launch_args"], request["recipe"], *request["args"]]
    )
    os.environ.clear()
    os.environ.update(env)  # accelerate builds the launch environment on top of the caller's
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config.keys()) if defaults else []
        args.deepspeed_fields_from_accelerate_config = ",".join(
            [*fields, *(["mixed_precision"] * mp_from_config)]
        )
        _, base = prepare_deepspeed_cmd_env(args)
    elif args.use_fsdp or args.multi_gpu:
        base = prepare_multi_gpu_env(args)
    else:
        _, base = prepare_simple_launcher_cmd_env(args)
        return [base], True
    world = int(args.num_processes)
    run_id = f"fork-{os.getpid()}-{time.monotonic_ns()}"
    envs = []
    for rank in range(world):  # what torch elastic's local agent sets for each worker
        envs.append(
            {
                **base,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "GROUP_RANK": "0",
                "ROLE_RANK": str(rank),
                "ROLE_NAME": "default",
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "GROUP_WORLD_SIZE": "1",
                "ROLE_WORLD_SIZE": str(world),
                "MASTER_ADDR": base.get("MASTER_ADDR", "127.0.0.1"),
                "MASTER_PORT": str(args.main_process_port),
                "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": str(args.max_restarts or 0),
                "TORCHELASTIC_RUN_ID": run_id,
                "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", "1"),
            }
        )
    return envs, True


def run_rank(request: dict, env: dict, index: int) -> None:
    """In the rank's fork: the recipe as `python RECIPE ARGS` runs it; never returns."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    atexit._clear()  # the server's exit handlers are not the run's
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    if request.get("rank_logs"):
        _output_to(request["rank_logs"][index])
    if request.get("ranks") and "OMP_NUM_THREADS" in env:  # what a new interpreter would start with
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [request["recipe"], *request["args"]]
    sys.path[0] = str(Path(request["recipe"]).resolve().parent)  # as `python SCRIPT` puts its folder first
    code = 0
    try:
        runpy.run_path(request["recipe"], run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if exit_.code is not None and not isinstance(exit_.code, int):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, then status 1
        traceback.print_exc()
        code = 1
    # The end of an interpreter (Py_FinalizeEx): threading's own exit hooks (they tell thread pools, e.g.
    # inductor's compile workers, to stop) and a join of the non-daemon threads, then the run's exit handlers.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _output_to(path: str) -> None:
    log = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


def launch(request: dict) -> None:
    """In the launcher's fork: start every rank, wait, stop the rest when one fails; never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # A signal to the run's process group reaches every rank; like torch elastic's agent, the launcher
    # waits for them to act on it (a SIGTERM'd rank saves a checkpoint first).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.setsid()  # the run's process group: killing it ends every rank
    _output_to(request["log"])  # accelerate's own warnings go where `accelerate launch` would print them
    code = 1
    try:
        envs, accelerate = (request["ranks"], False) if request.get("ranks") else rank_environments(request)
        ranks = []
        for index, env in enumerate(envs):
            pid = os.fork()
            if pid == 0:
                run_rank(request, env, index)
            ranks.append(pid)
        codes = {}
        while len(codes) < len(ranks):
            pid, status = os.wait()
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and len(ranks) > 1:  # torch elastic: stop the others, SIGKILL after a grace
                _stop([p for p in ranks if p not in codes], codes)
        statuses = [codes[p] for p in ranks]
        code = (1 if any(statuses) else 0) if accelerate else next((c for c in statuses if c), 0)
    except BaseException:  # noqa: BLE001 - a bad launch config: reported in the run's log
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    # This fork's CPU seconds and its ranks' (a fork's counters start at zero; the ranks', their waited-for
    # children included, are added as each is waited for): the tests' CPU log counts them.
    cpu_s = sum(
        u.ru_utime + u.ru_stime
        for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )
    rc = request["log"] + ".rc"
    Path(rc + ".tmp").write_text(json.dumps({"code": code, "cpu_s": cpu_s}))
    os.replace(rc + ".tmp", rc)
    os._exit(0)


def _stop(running: list[int], codes: dict) -> None:
    """SIGTERM the ranks still running, SIGKILL those still there after the grace; all are waited for."""
    for pid in running:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    while any(p not in codes for p in running) and time.monotonic() < deadline:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
        else:
            time.sleep(0.05)
    for pid in running:
        if pid not in codes:
            os.kill(pid, signal.SIGKILL)
            codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def serve() -> None:
    preload()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # launcher forks are reaped without waiting
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            launch(request)
        print(json.dumps({"pid": pid}), flush=True)


if __name__ == "__main__":
    serve()
