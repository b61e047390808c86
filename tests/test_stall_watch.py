"""StallWatch names the rank that stopped beating, over a real TCPStore (the launcher's, in a launch)."""

from datetime import timedelta

import pytest
import torch.distributed as dist

from lmpretrain.run.stall_watch import CollectiveTimeout, StallWatch, is_timeout
from recipe_runner import free_port

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
    watches = [StallWatch(r, 3, lambda r=r: steps[r], timeout_s=10, interval_s=0.05) for r in range(3)]
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


def test_other_errors_pass_through_and_a_single_process_has_no_store(launcher_store):
    with pytest.raises(ValueError), StallWatch(0, 2, lambda: 0, timeout_s=10, interval_s=0.05):
        raise ValueError("not a timeout")
    assert StallWatch(0, 1, lambda: 0, timeout_s=10).store is None
    assert is_timeout(GLOO_TIMEOUT) and not is_timeout(RuntimeError("Connection closed by peer"))
