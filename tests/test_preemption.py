"""Preemption: SIGTERM/SIGINT finish the step, save and exit 0; a second signal exits at once."""

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

from lmpretrain.checkpoint import Checkpointer, checkpoint_problem
from lmpretrain.preemption import PreemptionHandler
from recipe_runner import launch_two_ranks

SRC = str(Path(__file__).resolve().parents[1] / "src")

# A training loop in miniature: one optimizer step per iteration, a checkpoint every 3 steps, and the
# preemption check once per step, as in the recipe. With "hang-in-save", the save that the signal
# asks for blocks half way through writing, so the test can send the second signal during it.
LOOP_CHILD = textwrap.dedent("""
    import sys, time, torch
    from lmpretrain.checkpoint import Checkpointer
    from lmpretrain.preemption import PreemptionHandler

    out, mode = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    ck = Checkpointer(out)
    preemption = PreemptionHandler(duplicate_window_s=0.2)
    step = 0

    def save():
        ck.save(step, model=model, optimizer=optimizer, data_state={"streams": {0: {"pos": step}}},
                trainer_state={"step": step, "world_size": 1})

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
        child.send_signal(sig)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0, err
    assert f"received {sig.name}: will save after this step and exit" in err
    assert err.count("received") == 1
    ck = Checkpointer(tmp_path / "run")
    latest = ck.latest()
    saved_step = json.loads((latest / "trainer_state.json").read_text())["step"]
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
    from lmpretrain.preemption import PreemptionHandler

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
    outputs = launch_two_ranks(script)
    assert "rank 0: before=False after=True" in outputs[0]
    assert "rank 1: before=False after=True" in outputs[1]
