"""StallWatch names the rank that stopped beating, over a real TCPStore (the launcher's, in a launch):
when a collective times out, and on its own once a step has stalled for report_s (NCCL's watchdog aborts
without raising, so only the watch can speak there), shown with 2 real gloo ranks whose collective
timeout is far longer than the watch's."""

import textwrap
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lmpretrain.config import config_problems, load_config
from lmpretrain.run.stall_watch import CollectiveTimeout, StallWatch, is_timeout
from recipe_runner import SMOKE, free_port, launch_ranks

# A live rank's beat thread must run within the 3 beats a judgement spans; on 2 busy cores running the
# whole suite a 0.05 s beat can miss that window, and a live rank is then named as stopped.
BEAT_S = 0.25
GLOO_TIMEOUT = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv")


@pytest.fixture
def launcher_store(monkeypatch):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    yield store


def test_the_rank_that_stopped_beating_is_named_with_its_step(launcher_store):
    steps = {0: 7, 1: 6, 2: 6}
    watches = [
        StallWatch(r, 3, lambda r=r: steps[r], timeout_s=10, report_s=60, interval_s=BEAT_S) for r in range(3)
    ]
    watches[1].close()  # rank 1 stops: its beats stop with it
    with pytest.raises(CollectiveTimeout) as err, watches[0]:
        raise GLOO_TIMEOUT
    assert str(err.value).startswith(
        "rank 0 waited run.collective_timeout_s=10 s in a collective during step 8 for rank(s) 1 "
        "(stopped during step 7); stopping"
    )
    # rank 0 has stopped beating too now (its watch ended with the error)
    assert watches[2].stalled() == "rank(s) 0 (stopped during step 8), 1 (stopped during step 7)"
    watches[2].close()


def test_a_stalled_step_makes_the_lowest_live_rank_name_the_stopped_one_once(launcher_store):
    """No collective raises here: each watch judges its own step's progress. Ranks 0, 2 and 3 wait in
    step 5 while rank 2 stops; only rank 0 (the lowest still beating) speaks, and once."""
    said = {r: [] for r in range(4)}
    watches = [
        StallWatch(r, 4, lambda: 4, timeout_s=600, report_s=0.3, interval_s=BEAT_S, say=said[r].append)
        for r in range(4)
    ]
    watches[2].close()
    wait_for(said[0])
    time.sleep(12 * BEAT_S)  # a few more judgements' time: nobody else speaks, rank 0 not again
    for w in watches:
        w.close()
    assert len(said[0]) == 1 and not said[1] and not said[3], said
    assert said[0][0].startswith("no step has ended for ")
    assert "(rank 0 is in step 5): rank(s) 2 (stopped during step 5) no longer beat" in said[0][0]
    assert "run.collective_timeout_s=600 s (on NCCL the watchdog aborts every process)" in said[0][0]


def wait_for(said: list, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not said and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_live_rank_stuck_at_an_earlier_step_is_named(launcher_store):
    steps = {0: 9, 1: 8}
    said = []
    watches = [
        StallWatch(
            r, 2, lambda r=r: steps[r], timeout_s=600, report_s=0.3, interval_s=BEAT_S, say=said.append
        )
        for r in range(2)
    ]
    wait_for(said)
    for w in watches:
        w.close()
    assert len(said) == 1 and "rank(s) 1 (still at step 9) beat but did not finish it" in said[0], said


def test_a_long_step_of_live_ranks_at_one_step_is_not_reported(launcher_store):
    """A long eval or save: the step does not move for longer than report_s, but every rank beats."""
    said = []
    watches = [
        StallWatch(r, 2, lambda: 3, timeout_s=600, report_s=0.2, interval_s=BEAT_S, say=said.append)
        for r in range(2)
    ]
    time.sleep(10 * BEAT_S)  # several judgements
    for w in watches:
        w.close()
    assert said == []


def test_other_errors_pass_through_and_a_single_process_has_no_store(launcher_store):
    with pytest.raises(ValueError), StallWatch(0, 2, lambda: 0, timeout_s=10, interval_s=0.05):
        raise ValueError("not a timeout")
    assert StallWatch(0, 1, lambda: 0, timeout_s=10).store is None
    assert is_timeout(GLOO_TIMEOUT) and not is_timeout(RuntimeError("Connection closed by peer"))


def test_the_report_must_come_before_the_collective_timeout():
    cfg = load_config([str(SMOKE), "--run.collective_timeout_s=30", "--run.stall_report_s=30"])
    assert any(
        p.startswith("run.stall_report_s=30 must be > 0 and less than run.collective_timeout_s=30")
        for p in config_problems(cfg, 1)
    )


# Two real gloo ranks. Rank 1 stops (SIGSTOP) as step 8 starts; rank 0 waits for it in an all-reduce whose
# timeout (600 s) is far longer than the watch's report time (2 s). The watch's line, then rank 0 ends
# the test: it lets rank 1 go on (SIGCONT), which exits, and exits itself.
STOPPED_RANK = textwrap.dedent("""
    import os, signal, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from lmpretrain.run.stall_watch import StallWatch

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())

    def named(line):
        print(line, flush=True)
        os.kill(pids[1], signal.SIGCONT)
        os._exit(0)

    watch = StallWatch(rank, 2, lambda: 7, timeout_s=600, report_s=2, interval_s=0.2, say=named)
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(0)  # let go by rank 0
    dist.all_reduce(torch.ones(1))
    sys.exit("the all-reduce returned: rank 1 took part")
""")


@pytest.mark.slow
def test_a_stopped_rank_is_named_by_the_watch_long_before_the_collective_times_out(tmp_path):
    script = tmp_path / "stopped_rank.py"
    script.write_text(STOPPED_RANK)
    outputs = launch_ranks(script, timeout=60)  # the collective's own timeout would take 600 s
    assert "(rank 0 is in step 8): rank(s) 1 (stopped during step 8) no longer beat" in outputs[0], outputs
    assert "run.collective_timeout_s=600 s" in outputs[0]
