"""scripts/slurm/pretrain.sbatch's control flow, with stand-in `srun` and `scontrol` commands on PATH
(bash scripts that record their calls): after a run that saved and stopped on the time-limit signal the
job requeues itself; after a run that finished, or failed, it does not.

SLURM sends the time-limit signal (--signal=B:TERM@120) to the batch shell only; the test does the same.
"""

import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "scripts" / "slurm" / "pretrain.sbatch"

# The stand-in srun runs its command on this one "node" (as srun does on each); the stand-in python
# records its arguments one per line, then behaves as $FAKE_RUN says. "preempted" runs until SIGTERM,
# then "saves" and exits 0 as the recipe does; "finished" exits 0; "failed" exits 2.
SRUN = textwrap.dedent("""\
    #!/bin/bash
    printf '%s\\n' "$1" > "$CALLS/srun"
    shift  # --kill-on-bad-exit=1
    SLURM_NODEID=0 exec "$@"
""")
PYTHON = textwrap.dedent("""\
    #!/bin/bash
    printf '%s\\n' "$@" > "$CALLS/python"
    case "$FAKE_RUN" in
        preempted)
            trap 'echo "stopped by signal after step 7"; touch "$CALLS/saved"; exit 0' TERM
            touch "$CALLS/started"
            while true; do sleep 0.05; done ;;
        finished) echo "done: step 20"; exit 0 ;;
        failed) echo "error: training diverged"; exit 2 ;;
    esac
""")
SCONTROL = textwrap.dedent("""\
    #!/bin/bash
    # The second host comes late: a reader that stops at the first line must not fail the script.
    if [ "$1" = show ]; then echo node-a; sleep 0.2; echo node-b; exit 0; fi
    printf '%s\\n' "$*" >> "$CALLS/scontrol"
""")


def start(tmp_path, fake_run: str, overrides=("--train.max_steps=20",), env=None):
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    calls.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("python", PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "CALLS": str(calls),
        "FAKE_RUN": fake_run,
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_NNODES": "2",
        **(env or {}),
    }
    proc = subprocess.Popen(
        ["bash", str(SBATCH), "configs/gpt2-124m.yaml", *overrides],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, calls


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.02)


def test_a_run_stopped_by_the_time_limit_signal_is_requeued(tmp_path):
    proc, calls = start(tmp_path, "preempted")
    wait_for(calls / "started", proc)
    proc.send_signal(signal.SIGTERM)  # the batch shell only, as --signal=B:TERM does
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    assert (calls / "saved").exists()  # the shell passed the signal on to srun, which saved
    assert (calls / "scontrol").read_text() == "requeue 4242\n"
    assert "requeueing job 4242" in out
    assert (calls / "srun").read_text() == "--kill-on-bad-exit=1\n"
    assert launched(calls) == [
        *("-m", "lmpretrain.launch", "--config_file", "configs/accelerate/ddp.yaml"),
        *("--max_restarts", "2", "--monitor_interval", "5", "--num_machines", "2", "--machine_rank", "0"),
        *("--num_processes", "16", "--main_process_ip", "node-a", "--main_process_port", "29500"),
        *("recipes/pretrain.py", "configs/gpt2-124m.yaml", "--train.max_steps=20"),
    ]


def launched(calls: Path) -> list[str]:
    return (calls / "python").read_text().splitlines()


def test_overrides_with_spaces_and_quotes_reach_the_recipe_exactly_and_launch_config_is_chosen(tmp_path):
    overrides = ["--data.train=[{files: [/d], format: tokens}]", '--train.precision="no"']
    proc, calls = start(
        tmp_path, "finished", overrides, env={"LAUNCH_CONFIG": "configs/accelerate/fsdp.yaml"}
    )
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    argv = launched(calls)
    assert argv[-2:] == overrides
    assert argv[argv.index("--config_file") + 1] == "configs/accelerate/fsdp.yaml"


def test_the_log_is_appended_across_requeues():
    assert "#SBATCH --open-mode=append" in SBATCH.read_text().splitlines()


@pytest.mark.parametrize(("fake_run", "returncode"), [("finished", 0), ("failed", 2)])
def test_a_finished_or_failed_run_is_not_requeued(tmp_path, fake_run, returncode):
    proc, calls = start(tmp_path, fake_run)
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == returncode, out
    assert not (calls / "scontrol").exists(), (calls / "scontrol").read_text()
    assert "requeueing" not in out
    assert ("the run has finished" in out) == (fake_run == "finished")
