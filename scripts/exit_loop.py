#!/usr/bin/env python
"""Do 2-process runs exit cleanly under CPU contention? N consecutive smoke runs, one core kept busy.

    python scripts/exit_loop.py [--runs 40] [--launch cpu-ddp] [--out /tmp/exit-loop] [--section.field=value ...]

Each run is `accelerate launch --config_file configs/accelerate/<launch>.yaml recipes/pretrain.py
configs/smoke.yaml` in its own output dir, while another process spins on one core (as a busy machine
does to a job). A run passes when the launcher exits 0 and `final/` is complete: it loads with
`AutoModelForCausalLM` and `AutoTokenizer` and no `.tmp-final-*` directory is left. Failing runs keep their
output dir and log; passing ones are deleted. Prints one line per run and the tally; exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = Path(sys.executable).with_name("accelerate")
# What a crash at exit looks like (the abort this loop was written to catch, and its kin).
CRASH_SIGNS = ("terminate called", "SIGABRT", "Signal 6", "Traceback", "core dumped")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def final_problem(final: Path) -> str | None:
    """Why `final/` is not a complete export, or None when it loads."""
    if not final.is_dir():
        return "no final/"
    leftovers = [p.name for p in final.parent.iterdir() if p.name.startswith(".tmp-final")]
    if leftovers:
        return f"leftover {leftovers}"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        AutoModelForCausalLM.from_pretrained(final)
        AutoTokenizer.from_pretrained(final)
    except Exception as err:  # noqa: BLE001 - reported, this is the check
        return f"does not load: {type(err).__name__}: {err}"
    return None


def one_run(index: int, out: Path, launch: str, overrides: list[str]) -> tuple[bool, str]:
    run_dir = out / f"run-{index:03d}"
    cmd = [
        str(ACCELERATE),
        "launch",
        "--config_file",
        str(ROOT / "configs" / "accelerate" / f"{launch}.yaml"),
        "--main_process_port",
        str(free_port()),
        str(ROOT / "recipes" / "pretrain.py"),
        str(ROOT / "configs" / "smoke.yaml"),
        f"--run.output_dir={run_dir}",
        "--logging.wandb_mode=offline",
        *overrides,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "WANDB_"))}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", WANDB_SILENT="true", PYTHONUNBUFFERED="1")
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    elapsed = time.monotonic() - started
    problem = final_problem(run_dir / "final")
    signs = sorted({s for s in CRASH_SIGNS if s in proc.stdout})
    ok = proc.returncode == 0 and problem is None and not signs
    (out / f"run-{index:03d}.log").write_text(proc.stdout)
    detail = f"exit {proc.returncode}, {elapsed:.1f}s, final/: {problem or 'complete'}"
    if signs:
        detail += f", log shows {signs}"
    if ok:
        shutil.rmtree(run_dir, ignore_errors=True)
        (out / f"run-{index:03d}.log").unlink()
    return ok, detail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--launch", default="cpu-ddp", help="a configs/accelerate/<name>.yaml")
    parser.add_argument("--out", default="/tmp/exit-loop")
    parser.add_argument("--no-busy", action="store_true", help="do not keep a core busy (the idle baseline)")
    args, overrides = parser.parse_known_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    busy = None
    if not args.no_busy:
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    passed = 0
    try:
        for i in range(args.runs):
            ok, detail = one_run(i, out, args.launch, overrides)
            passed += ok
            print(f"run {i + 1:3d}/{args.runs}: {'ok  ' if ok else 'FAIL'} {detail}", flush=True)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    load = "one core kept busy" if busy is not None else "no extra load"
    print(
        f"{passed}/{args.runs} runs exited 0 with a complete final/ ({args.launch}, {load}); logs of failures in {out}"
    )
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
