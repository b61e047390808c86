"""`python -m lmpretrain.launch`'s pieces that keep a refused multi-rank launch on one message: the user
error is found among all of torch elastic's failures, and torch elastic's own log lines about the failure
are held back unless it turns out to be something else. (End to end: tests/test_failures.py.)"""

import json
import logging
import time

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from lmpretrain.launch import _HeldFailureLines, user_error_message

ELASTIC = "torch.distributed.elastic.multiprocessing.api"


def failure(
    tmp_path, rank: int, exitcode: int, message: str | None = None, timestamp: int = 0
) -> ProcessFailure:
    """torch elastic's record of a failed rank, read from an error file as the agent reads it (none: a rank
    that wrote no error file, e.g. one that lost its peer in a collective)."""
    path = tmp_path / f"error-{rank}.json"
    if message is not None:
        path.write_text(json.dumps({"message": message, "timestamp": timestamp}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_the_user_error_is_found_among_all_failures_not_only_the_first(tmp_path):
    now = int(time.time())
    lost_peer = failure(tmp_path, 0, 1)  # no error file: its timestamp is the agent's clock, now
    refused = failure(tmp_path, 1, 2, "error: data.transforms: f.py:boom raised ValueError: x", timestamp=now)
    assert lost_peer.timestamp >= refused.timestamp and lost_peer.message.startswith("To enable traceback")
    # torch elastic's own pick of the first failure may be the rank that lost its peer (a tie in whole seconds)
    assert (
        user_error_message({0: lost_peer, 1: refused})
        == "error: data.transforms: f.py:boom raised ValueError: x"
    )
    # the earliest of two user errors
    early = failure(tmp_path, 2, 2, "error: early", timestamp=now - 5)
    assert user_error_message({0: lost_peer, 1: refused, 2: early}) == "error: early"
    # no user error: a crash, a signal, an exit code 2 without our message
    assert user_error_message({0: lost_peer}) is None
    assert user_error_message({0: failure(tmp_path, 3, -9)}) is None
    assert user_error_message({0: failure(tmp_path, 4, 2, "Traceback ...", timestamp=now)}) is None


def test_torch_elastics_failure_lines_are_held_and_shown_when_the_failure_is_something_else(caplog):
    logger = logging.getLogger(ELASTIC)
    caplog.set_level(logging.INFO, logger=ELASTIC)
    held = _HeldFailureLines()
    try:
        # as torch elastic's PContext logs them (multiprocessing/api.py)
        logger.warning("Sending process %s closing signal %s", 4905, "SIGTERM")
        logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 1, 0, 4904, "python")
        logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 2, 1, 4905, "python")
        logger.info("another line")
        assert [r.getMessage() for r in caplog.records] == ["another line"]
        held.release()
    finally:
        logger.removeFilter(held)
    assert [r.getMessage() for r in caplog.records] == [
        "another line",
        "Sending process 4905 closing signal SIGTERM",
        "failed (exitcode: 1) local_rank: 0 (pid: 4904) of binary: python",
        "failed (exitcode: 2) local_rank: 1 (pid: 4905) of binary: python",
    ]
    assert held not in logger.filters  # released: later lines pass


RANKS = """
import os, sys, time
import torch
import torch.distributed as dist
from lmpretrain.errors import DataError
from lmpretrain.launch import report_lost_peer, report_user_error

dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 0:  # stops on a user error while rank 1 waits for it in a collective
    code = report_user_error(DataError("data.transforms: f.py:boom raised ValueError: x"))
    sys.stdout.flush()
    os._exit(code)
try:
    dist.broadcast(torch.zeros(4), src=0)
except RuntimeError as err:
    code = report_lost_peer(err)
    print(f"lost a peer: {code}", flush=True)
    os._exit(code if code is not None else 9)
os._exit(8)
"""


def test_a_rank_that_loses_its_peer_to_a_user_error_puts_its_traceback_in_its_error_file(tmp_path):
    """Two real gloo ranks: rank 0 stops on a user error, rank 1's broadcast then fails on the lost
    connection. Rank 1 prints no traceback and exits 1 with it in torch elastic's error file; the launcher's
    pick among the two failures, as torch elastic reads them, is rank 0's message."""
    import subprocess
    import sys

    from recipe_runner import ROOT, env_for_runs, free_port

    port, procs = free_port(), []
    for rank in (0, 1):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_PORT": str(port)}
        env.update(MASTER_ADDR="127.0.0.1", TORCHELASTIC_ERROR_FILE=str(tmp_path / f"error-{rank}.json"))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", RANKS],
                cwd=ROOT,
                env=env_for_runs(env),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 1], outputs
    assert "lost a peer: 1" in outputs[1] and "Traceback" not in outputs[1], outputs[1]
    failures = {
        rank: ProcessFailure(rank, p.pid, p.returncode, str(tmp_path / f"error-{rank}.json"))
        for rank, p in enumerate(procs)
    }
    lost = failures[1].message
    assert lost["message"].startswith("RuntimeError: ") and "by peer" in lost["message"]
    assert lost["extraInfo"]["py_callstack"].startswith("Traceback (most recent call last)")
    assert ", in broadcast\n" in lost["extraInfo"]["py_callstack"]  # where it failed: torch's broadcast
    assert user_error_message(failures) == "error: data.transforms: f.py:boom raised ValueError: x"
    assert user_error_message({1: failures[1]}) is None  # alone, it is shown by torch elastic's summary
