"""scripts/slurm/pretrain.sbatch under a real single-node SLURM (`make slurm-cluster`: munged, slurmctld,
slurmd and slurmdbd on this machine; the tests marked `slurm` are skipped where `sinfo` does not answer,
and fail instead under LMPRETRAIN_REQUIRE_SLURM=1, as in CI).

Three jobs are submitted at once through real `sbatch`, on CPU: LAUNCH_CONFIG=configs/accelerate/cpu-ddp.yaml
(2 gloo ranks under torch elastic's agent, the launcher a GPU node runs), `--nodes=1 --gpus-per-node=0`:
* straight: the smoke recipe to its last step;
* requeued: the same run, whose time limit is cut short while it trains. SLURM's shortest `--time` is a
  minute and it checks time limits every 30 s, so the test keeps the script's own `--signal=B:TERM@120`
  and, once the run has logged a step, lowers the job's limit (`scontrol update TimeLimit=`) to the whole
  minutes that put the signal's time in the past and the limit itself a minute or more ahead: SLURM sends
  the signal at its next check. When the script says it got it, the test raises the limit again for the
  requeued allocation. Its first allocation runs the recipe through tests/forks/slow_rank.py (rank 0
  sleeps before each batch, so the run is still training when the signal comes, at no CPU cost);
* failed: a config error (exit 2).
The jobs' CPU time (sacct's TotalCPU) goes into the suite's CPU log with the forked runs'.

The 2-node command line (ranks per node, main host, machine rank) is checked with a stand-in `srun` that
records its arguments, in a run that ends without a signal: one node cannot show it. The signal path is
tested for real only (a real srun answers SIGTERM by SIGKILLing its tasks; a stand-in that only `exec`s
hid that).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import recipe_runner as rr

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "scripts" / "slurm" / "pretrain.sbatch"
STEPS = 24
COMMON = [
    str(rr.SMOKE.relative_to(ROOT)),
    f"--train.max_steps={STEPS}",
    *rr.QUICK,
    "--logging.wandb_mode=disabled",
    "--run.threads=1",
    # overrides with spaces and quotes: they must reach the recipe as typed
    "--data.train=[{name: python-stdlib, split: train}]",
    '--train.precision="no"',
]


def sh(*cmd: str, check: bool = True) -> str:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=60).stdout


SACCT = ("sacct", "--duplicates", "--noheader", "--parsable2", "--format=JobID,State,ExitCode,TotalCPU")


class Job:
    """One job through real sbatch: the shipped script, this venv's python, LAUNCH_CONFIG `launch`."""

    def __init__(self, name: str, folder: Path, overrides: list[str], launch: str, recipe: str = ""):
        self.name, self.out, self.log = name, folder / name, folder / f"{name}.out"
        env = rr.env_for_runs(
            {
                "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # this venv's python
                "LAUNCH_CONFIG": f"configs/accelerate/{launch}.yaml",
                "GPUS_PER_NODE": "2" if launch == "cpu-ddp" else "1",
                "MAIN_PORT": str(rr.free_port()),
                "SLOW_RANK": "0",
                "SLOW_RANK_S": "2",
                **({"RECIPE": recipe} if recipe else {}),
            }
        )
        cmd = ["sbatch", "--parsable", f"--job-name=lmpretrain-test-{name}", "--nodes=1", "--gpus-per-node=0"]
        cmd += ["--cpus-per-task=1", "--time=10", f"--chdir={ROOT}", f"--output={self.log}"]
        cmd += [str(SBATCH), *COMMON, *overrides, f"--run.output_dir={self.out}"]
        submitted = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert submitted.returncode == 0, submitted.stderr
        self.id = submitted.stdout.strip().split(";")[0]

    def text(self) -> str:
        # two ranks' progress bars interleave in the log, splitting multi-byte characters
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def queued(self) -> bool:
        return bool(sh("squeue", "--noheader", "--jobs", self.id, "--format=%i", check=False).strip())

    def accounting(self) -> list[list[str]]:
        """sacct's rows (job, state, exit code, CPU time) of every allocation and step: --duplicates shows
        each allocation of a requeued job."""
        return [row.split("|") for row in sh(*SACCT, "--jobs", self.id).splitlines() if row]

    def states(self) -> list[tuple[str, str]]:
        """(state, exit code) of each allocation, in order."""
        return [(state, code) for job, state, code, _ in self.accounting() if job == self.id]


def cpu_seconds(total: str) -> float:
    """sacct's TotalCPU: [D-][HH:]MM:SS[.mmm]."""
    days, _, clock = total.rpartition("-")
    seconds = sum(float(part) * 60**i for i, part in enumerate(reversed(clock.split(":"))))
    return seconds + 86400 * int(days or 0)


def wait(what: str, condition, timeout: float, jobs=()) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            logs = "\n".join(f"---- {j.name} ({j.id}):\n{j.text()[-3000:]}" for j in jobs)
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{sh('squeue', check=False)}\n{logs}")
        time.sleep(0.5)


def elapsed_s(job_id: str) -> int:
    """The job's run time so far, from squeue ([D-][HH:]MM:SS)."""
    return int(cpu_seconds(sh("squeue", "--noheader", "--jobs", job_id, "--format=%M").strip()))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slurm")
    straight = Job("straight", folder, [], "cpu-ddp")
    requeued = Job("requeued", folder, [], "cpu-ddp", recipe="tests/forks/slow_rank.py")
    failed = Job("failed", folder, ["--data.seq_len=4096"], "cpu")  # longer than the model's 128 positions
    everyone = (straight, requeued, failed)
    try:
        wait("the run to log a step", lambda: rr.read_metrics(requeued.out), 300, everyone)
        # --signal=B:TERM@120: at L minutes the signal is due at L*60 - 120 s, now or past; the limit
        # itself is at least 60 s ahead (SLURM checks every 30 s, then the ranks' step and save).
        minutes = (elapsed_s(requeued.id) + 120) // 60
        sh("scontrol", "update", f"JobId={requeued.id}", f"TimeLimit={minutes}")
        wait(
            "the time-limit signal",
            lambda: "SIGTERM: the time limit is near" in requeued.text(),
            90,
            everyone,
        )
        # the next allocation runs to the end
        sh("scontrol", "update", f"JobId={requeued.id}", "TimeLimit=10")
        wait("the jobs to end", lambda: not any(j.queued() for j in everyone), 600, everyone)
        # the accounting record of a job's end reaches slurmdbd shortly after the job leaves the queue
        wait(
            "sacct's records",
            lambda: all(j.states() and j.states()[-1][0] != "RUNNING" for j in everyone),
            60,
        )
    finally:
        for job in everyone:
            sh("scancel", job.id, check=False)
    rr.count_cpu_s(sum(cpu_seconds(row[3]) for j in everyone for row in j.accounting() if row[0] == j.id))
    return {job.name: job for job in everyone}


@pytest.mark.slow
@pytest.mark.slurm
def test_a_run_at_its_time_limit_saves_requeues_itself_and_ends_bit_identical(jobs):
    straight, requeued = jobs["straight"], jobs["requeued"]
    log = requeued.text()
    # One log, appended to by both allocations.
    assert f"job {requeued.id}, allocation 1 on" in log and f"job {requeued.id}, allocation 2 on" in log, log
    stopped = int(re.search(r"stopped by signal after step (\d+);", log).group(1))
    assert 0 < stopped < STEPS, log
    # The agent passed SIGTERM to its ranks, which saved at the step's end; then the script requeued.
    assert "the launcher stopped on SIGTERM" in log and f"requeueing job {requeued.id}" in log
    assert f"resumed from {requeued.out}/checkpoints/step-{stopped:08d} at step {stopped}" in log, log
    assert log.rstrip().endswith(f"the run has finished: job {requeued.id} is done"), log[-2000:]
    assert "forcing job termination" not in log and "Killed" not in log
    # SLURM's own record: the first allocation ended REQUEUED, the second COMPLETED.
    assert requeued.states() == [("REQUEUED", "0:0"), ("COMPLETED", "0:0")], requeued.accounting()
    # Final weights bit-identical to the straight run's.
    mine = load_file(requeued.out / "final" / "model.safetensors")
    theirs = load_file(straight.out / "final" / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.slow
@pytest.mark.slurm
def test_a_finished_run_completes_without_requeue_with_its_overrides_whole(jobs):
    straight = jobs["straight"]
    assert straight.states() == [("COMPLETED", "0:0")], straight.accounting()
    log = straight.text()
    assert "requeueing" not in log and f"the run has finished: job {straight.id} is done" in log
    saved = yaml.safe_load((straight.out / "config.yaml").read_text())
    assert saved["train"]["precision"] == "no"  # a string: without its quotes YAML reads `no` as false
    assert [source["name"] for source in saved["data"]["train"]] == ["python-stdlib"]


@pytest.mark.slow
@pytest.mark.slurm
def test_a_failed_run_fails_the_job_without_requeue(jobs):
    failed = jobs["failed"]
    assert failed.states() == [("FAILED", "2:0")], failed.accounting()
    log = failed.text()
    assert "seq_len" in log and f"the run failed (exit 2): job {failed.id} is not requeued" in log, log
    assert "requeueing" not in log and not (failed.out / "checkpoints").exists()


# ---- the multi-node command line, with stand-ins ---------------------------------------------------------

# The stand-in srun runs its command on this one "node" (SLURM_NODEID=0); the stand-in python records its
# arguments one per line and exits 0, as a run that reaches train.max_steps does.
SRUN = textwrap.dedent("""\
    #!/bin/bash
    printf '%s\\n' "$1" > "$CALLS/srun"
    shift  # --kill-on-bad-exit=1
    SLURM_NODEID=0 exec "$@"
""")
PYTHON = textwrap.dedent("""\
    #!/bin/bash
    printf '%s\\n' "$@" > "$CALLS/python"
    echo "done: step 20"
""")
SCONTROL = textwrap.dedent("""\
    #!/bin/bash
    # The second host comes late: a reader that stops at the first line must not fail the script.
    if [ "$1" = show ]; then echo node-a; sleep 0.2; echo node-b; exit 0; fi
    printf '%s\\n' "$*" >> "$CALLS/scontrol"
""")


def test_two_nodes_get_one_launcher_each_with_the_whole_world_and_the_first_host_as_main(tmp_path):
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
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_NNODES": "2",
    }
    done = subprocess.run(
        ["bash", str(SBATCH), "configs/gpt2-124m.yaml", "--train.max_steps=20"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the run has finished: job 4242 is done" in done.stdout
    assert not (calls / "scontrol").exists()  # no requeue
    assert (calls / "srun").read_text() == "--kill-on-bad-exit=1\n"
    assert (calls / "python").read_text().splitlines() == [
        *("-m", "lmpretrain.launch", "--config_file", "configs/accelerate/ddp.yaml"),
        *("--max_restarts", "2", "--monitor_interval", "5", "--num_machines", "2", "--machine_rank", "0"),
        *("--num_processes", "16", "--main_process_ip", "node-a", "--main_process_port", "29500"),
        *("recipes/pretrain.py", "configs/gpt2-124m.yaml", "--train.max_steps=20"),
    ]


def test_sacct_cpu_time_reads_every_form():
    assert cpu_seconds("00:13.712") == pytest.approx(13.712)
    assert cpu_seconds("01:02:03") == 3723 and cpu_seconds("1-00:00:01") == 86401
