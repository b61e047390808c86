"""Preemption: SIGTERM/SIGINT finish the step, save and exit 0; a second signal exits at once."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from accelerate import PartialState

from lmpretrain.checkpoint.checkpointer import Checkpointer, checkpoint_problem
from lmpretrain.run.preemption import PreemptionHandler
from recipe_runner import launch_ranks

pytestmark = pytest.mark.slow  # end-to-end: launches the recipe in subprocesses

SRC = str(Path(__file__).resolve().parents[1] / "src")

# A training loop in miniature: one optimizer step per iteration, a checkpoint every 3 steps, and the
# preemption check once per step, as in the recipe. With "hang-in-save", the save that the signal
# asks for blocks half way through writing, so the test can send the second signal during it.
LOOP_CHILD = textwrap.dedent("""
    import sys, time, torch
    from lmpretrain.checkpoint.checkpointer import Checkpointer
    from lmpretrain.run.preemption import PreemptionHandler

    out, mode = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    ck = Checkpointer(out)
    preemption = PreemptionHandler(duplicate_window_s=0.2)
    step = 0

    def save():
        ck.save(step, model=model, optimizer=optimizer, states={}, meta={"saved_step": step})

    while step < 100000:
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step == 3:
            save()
            print("READY", flush=True)
        stop = preemption.should_stop(ck.state)
        if stop and mode == "hang-in-save":
            def half_save(obj, f, *args, **kwargs):
                f.write(b"partial")
                f.flush()
                print("SAVING", flush=True)
                time.sleep(60)
            torch.save = half_save
        if stop:
            save()
            print(f"saved step {step}; exiting", flush=True)
            sys.exit(0)
        time.sleep(0.01)
    sys.exit(3)
""")


def start_loop(tmp_path: Path, mode: str) -> subprocess.Popen:
    script = tmp_path / "loop.py"
    script.write_text(LOOP_CHILD)
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "run"), mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = child.stdout.readline()
    if line.strip() != "READY":
        child.kill()
        pytest.fail(f"child did not start: {line!r} {child.communicate()}")
    return child


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_signal_saves_after_the_step_and_exits_0(tmp_path, sig):
    child = start_loop(tmp_path, "normal")
    try:
        time.sleep(0.5)  # past the step-3 save, so the save on the signal is a later step
        child.send_signal(sig)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0, err
    assert f"received {sig.name}: will save after this step and exit" in err
    assert err.count("received") == 1
    ck = Checkpointer(tmp_path / "run")
    latest = ck.latest()
    saved_step = json.loads((latest / "meta.json").read_text())["saved_step"]
    assert saved_step > 3 and f"saved step {saved_step}; exiting" in out


def test_second_signal_exits_at_once_and_the_last_checkpoint_survives(tmp_path):
    child = start_loop(tmp_path, "hang-in-save")
    try:
        child.send_signal(signal.SIGTERM)
        assert child.stdout.readline().strip() == "SAVING"
        time.sleep(0.3)  # past the duplicate window
        started = time.monotonic()
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=10)
        elapsed = time.monotonic() - started
    finally:
        child.kill()
    assert child.returncode == 128 + signal.SIGTERM, err
    assert elapsed < 5 and "exiting now without saving" in err
    ck = Checkpointer(tmp_path / "run")
    assert ck.latest() == tmp_path / "run" / "checkpoints" / "step-00000003"
    assert checkpoint_problem(ck.latest()) is None


def test_a_repeat_within_the_duplicate_window_is_the_same_request():
    # Launchers forward a Ctrl-C that the workers also got directly: that must not kill the save.
    with PreemptionHandler(verbose=False, duplicate_window_s=60) as handler:
        assert not handler.should_stop(PartialState())
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # Python runs handlers between bytecodes; give it a moment
        assert handler.received and handler.signal_name == "SIGINT"
        assert handler.should_stop(PartialState())


def test_restore_puts_back_the_previous_handlers():
    def sentinel(signum, frame):
        pass

    before = {sig: signal.signal(sig, sentinel) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with PreemptionHandler() as handler:
            assert signal.getsignal(signal.SIGTERM) == handler._handle
            assert signal.getsignal(signal.SIGINT) == handler._handle
        assert signal.getsignal(signal.SIGTERM) is sentinel and signal.getsignal(signal.SIGINT) is sentinel
    finally:
        for sig, previous in before.items():
            signal.signal(sig, previous)


def test_handler_outside_the_main_thread_is_refused():
    errors = []

    def make():
        try:
            PreemptionHandler()
        except RuntimeError as err:
            errors.append(str(err))

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]


RANK_WORKER = textwrap.dedent("""
    import os, signal, sys, time
    from accelerate import PartialState
    from lmpretrain.run.preemption import PreemptionHandler

    state = PartialState(cpu=True)
    assert state.num_processes == 2
    with PreemptionHandler() as handler:
        before = handler.should_stop(state)
        if state.process_index == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # only rank 1 is told to stop
            time.sleep(0.05)
        after = handler.should_stop(state)
    print(f"rank {state.process_index}: before={before} after={after}", flush=True)
    state.wait_for_everyone()
    state.destroy_process_group()  # an undestroyed gloo group can abort at interpreter exit
""")


def test_should_stop_agrees_across_ranks_when_only_one_is_signalled(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(RANK_WORKER)
    outputs = launch_ranks(script)
    assert "rank 0: before=False after=True" in outputs[0]
    assert "rank 1: before=False after=True" in outputs[1]


# ---- under the launcher -------------------------------------------------------------------------------

# A rank that ignores SIGTERM (a save that takes too long): the launcher must SIGKILL it after its grace.
STUBBORN_RANK = textwrap.dedent("""
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: print(f"rank {os.environ['RANK']} got SIGTERM", flush=True))
    print(f"rank {os.environ['RANK']} ready", flush=True)
    while True:
        time.sleep(0.05)
""")


def test_the_launcher_kills_ranks_its_grace_period_after_forwarding_sigterm(tmp_path):
    """accelerate launch (torch elastic) forwards SIGTERM, waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds
    (30 by default), then SIGKILLs; a save on SIGTERM must fit in that window."""
    import psutil

    import recipe_runner as rr

    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN_RANK)
    cmd = [str(rr.ACCELERATE), "launch", "--config_file", str(rr.ROOT / "configs/accelerate/cpu-ddp.yaml")]
    cmd += ["--main_process_port", str(rr.free_port()), str(script)]
    env = rr.env_for_runs({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3"})
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ready, deadline = 0, time.monotonic() + 120
        while ready < 2 and time.monotonic() < deadline and proc.poll() is None:
            # two ranks' unbuffered prints can share a line ("rank 0 readyrank 1 ready"): count, not test
            ready += proc.stdout.readline().count(" ready")
        assert ready == 2, "the ranks did not start"
        ranks = psutil.Process(proc.pid).children(recursive=True)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
        elapsed = time.monotonic() - started
    finally:
        proc.kill()
    assert "rank 0 got SIGTERM" in out and "rank 1 got SIGTERM" in out  # forwarded to the ranks
    assert 3 <= elapsed < 10, elapsed  # then killed after the grace period, not before
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks)
    assert proc.returncode != 0


# A rank whose save on SIGTERM takes a second, as the recipe's does (one write per line: the ranks share
# the launcher's stdout, unbuffered).
SAVING_RANK = textwrap.dedent("""
    import os, signal, sys, time
    def save(*_):
        time.sleep(1)
        os.write(1, f"rank {os.environ.get('RANK', '0')} saved\\n".encode())
        sys.exit(0)
    signal.signal(signal.SIGTERM, save)
    os.write(1, b"ready\\n")
    while True:
        time.sleep(0.05)
""")


@pytest.mark.parametrize(("launch", "ranks", "code"), [("cpu", 1, 0), ("cpu-ddp", 2, 128 + signal.SIGTERM)])
def test_sigterm_to_python_m_lmpretrain_launch_ends_it_after_its_ranks_saved(tmp_path, launch, ranks, code):
    """A scheduler signals a job step's processes and ends the step when its first one exits. accelerate's
    one-process launcher has no handler and died at once; this launcher passes the signal on and waits
    (exit 0, the child's). Torch elastic's agent waits for its ranks, then raises: one line, exit 143."""
    import recipe_runner as rr

    script = tmp_path / "saving.py"
    script.write_text(SAVING_RANK)
    cmd = [*rr.LAUNCHER, "--config_file", str(rr.ROOT / f"configs/accelerate/{launch}.yaml")]
    cmd += ["--main_process_port", str(rr.free_port()), str(script)]
    proc = subprocess.Popen(
        cmd, env=rr.env_for_runs(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        ready, deadline = 0, time.monotonic() + 120
        while ready < ranks and time.monotonic() < deadline and proc.poll() is None:
            ready += proc.stdout.readline().strip() == "ready"
        assert ready == ranks, "the ranks did not start"
        proc.send_signal(signal.SIGTERM)  # the launcher only: it must pass the signal on
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == code, out
    assert sorted(line for line in out.splitlines() if line.endswith(" saved")) == [
        f"rank {r} saved" for r in range(ranks)
    ]
    assert ("the launcher stopped on SIGTERM after passing it to its ranks" in out) == (ranks > 1)
    assert "Traceback" not in out


def test_grace_reads_torch_elastic_shutdown_timeout(monkeypatch):
    from lmpretrain.run.preemption import launcher_grace_s

    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert launcher_grace_s() == 30
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")
    assert launcher_grace_s() == 120


def test_ranks_stop_when_their_launcher_dies_and_a_second_live_run_is_refused(tmp_path):
    """torchrun puts ranks in their own sessions: a launcher killed with SIGKILL used to leave them
    training to the end as orphans. Now they save and stop."""
    import psutil

    import recipe_runner as rr
    from lmpretrain.checkpoint.checkpointer import Checkpointer

    out = tmp_path / "run"
    base = [*rr.QUICK, "--checkpoint.every=0", "--eval.every=0", "--optim.warmup_steps=1"]
    base += ["--logging.wandb_mode=disabled"]
    ranks: list[psutil.Process] = []
    with open(tmp_path / "first.log", "w") as log:
        first = rr.start(out, *base, "--train.max_steps=400", launch="cpu-ddp", log=log)
        try:
            rr.wait_for_step(first, out, 2)
            holder = json.loads((out / ".lock").read_text())["pid"]  # rank 0 holds the output dir
            second = rr.run(out, *base, "--train.max_steps=400", launch="cpu-ddp", check=False, timeout=300)
            ranks = [
                p
                for p in psutil.Process(first.pid).children(recursive=True)
                if "pretrain.py" in " ".join(p.cmdline())
            ]
            first.send_signal(signal.SIGKILL)  # the launcher only, as a lost agent or `kill -9 <launcher>`
            first.wait(timeout=30)
            gone, alive = psutil.wait_procs(ranks, timeout=60)
        finally:
            first.kill()
            for p in ranks:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
    assert second.returncode != 0, second.output[-3000:]  # the ranks exit 2; the launcher reports failure
    assert f"is in use by another live run (pid {holder}" in second.output
    assert "two runs would write the same checkpoints" in second.output and "pretrain:" not in second.output
    assert holder in [p.pid for p in ranks] and len(ranks) == 2 and not alive, alive
    log = (tmp_path / "first.log").read_text()
    # Whichever rank sees it first stops both: the stop is agreed on at the next step.
    assert "the launcher (pid" in log and "stopping as on SIGTERM" in log
    stopped_at = rr.read_metrics(out)[-1]["step"]
    assert stopped_at < 400 and not (out / "final").exists()
    assert Checkpointer(out).latest().name == f"step-{stopped_at:08d}"  # saved on the way out
    # (That a dead run leaves no lock behind is shown by every kill -9 then resume test.)
