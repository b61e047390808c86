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

# The stand-in srun: records its command line, then behaves as $FAKE_RUN says. "preempted" runs until
# SIGTERM, then "saves" and exits 0 as the recipe does; "finished" exits 0; "failed" exits 2.
SRUN = textwrap.dedent("""\
    #!/bin/bash
    printf '%s\\n' "$*" > "$CALLS/srun"
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


def start(tmp_path, fake_run: str) -> tuple[subprocess.Popen, Path]:
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    calls.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
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
    }
    proc = subprocess.Popen(
        ["bash", str(SBATCH), "configs/gpt2-124m.yaml", "--train.max_steps=20"],
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
    srun = (calls / "srun").read_text()
    assert "python -m lmpretrain.launch" in srun and "--num_processes 16" in srun
    assert "--main_process_ip node-a" in srun and "configs/gpt2-124m.yaml --train.max_steps=20" in srun


@pytest.mark.parametrize(("fake_run", "returncode"), [("finished", 0), ("failed", 2)])
def test_a_finished_or_failed_run_is_not_requeued(tmp_path, fake_run, returncode):
    proc, calls = start(tmp_path, fake_run)
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == returncode, out
    assert not (calls / "scontrol").exists(), (calls / "scontrol").read_text()
    assert "requeueing" not in out
    assert ("the run has finished" in out) == (fake_run == "finished")
