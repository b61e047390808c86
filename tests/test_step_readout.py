"""read_step, the optimizer step's one device->host read: integer counters come back exact (past 2^24, where
the float32 row rounded them, and past 2^53, where float64 would), and it makes one blocking transfer, as
counted by the probe train.profile_steps (and so the GPU check) uses: observe/host_transfers.py."""

import json
import textwrap

import pytest
import torch

from lmpretrain.observe.host_transfers import HostTransfers
from recipe_runner import launch_ranks

# Two gloo ranks through accelerate, each with its own counters; every rank combines the same rows.
TWO_RANKS = textwrap.dedent("""
    import json
    import torch
    from accelerate import Accelerator
    from lmpretrain.observe.host_transfers import HostTransfers
    from lmpretrain.run.step_readout import read_step

    accelerator = Accelerator(cpu=True)
    r = accelerator.process_index
    sums = {"loss": torch.tensor([10.0 + r, 4.0], dtype=torch.float64)}
    host = {
        "stop": (r == 1, "max"),
        "data/a/tokens": ([2**24 + 1, 2**53 + 2][r], "sum"),
        "ids": ([2**53 + 1, -5][r], "each"),
        "train/epoch": ([7, 5][r], "min"),
        "load_s": ([0.25, 0.5][r], "each"),
    }
    with HostTransfers(torch.device("cpu")) as probe:
        means, grad_norm, shared = read_step(accelerator, sums, host, torch.tensor(8), torch.tensor(1.5))
    print(f"rank {r}: {means} {grad_norm} {shared!r}")
    print("transfers", json.dumps(probe.counts))
""")


@pytest.mark.slow  # 2 processes
def test_two_ranks_combine_exact_counters_in_one_blocking_transfer(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    outputs = launch_ranks(script)
    tokens = 2**24 + 1 + 2**53 + 2
    assert float(tokens) != tokens and float(2**53 + 1) != 2**53 + 1  # float64 rounds these
    assert torch.tensor(2**24 + 1, dtype=torch.float32).item() != 2**24 + 1  # and float32 this (the old row)
    for r, out in enumerate(outputs):
        shared = {
            "stop": 1,
            "data/a/tokens": tokens,
            "ids": [2**53 + 1, -5],
            "train/epoch": 5,
            "load_s": [0.25, 0.5],
        }
        assert f"rank {r}: {{'loss': 2.625}} 1.5 {shared!r}" in out, out
        transfers = json.loads(next(line for line in out.splitlines() if line.startswith("transfers "))[10:])
        assert list(transfers.values()) == [1] and "/lmpretrain/run/step_readout.py:" in next(iter(transfers))


def test_the_probe_counts_reads_and_blocking_writes_but_not_async_ones():
    with HostTransfers(torch.device("cpu")) as probe:
        t = torch.arange(4.0)
        t.tolist()  # a read
        float(t[0])  # a read
        torch.tensor([1.0, 2.0], device="cpu")  # Python numbers made on the run's device: a pageable copy
        torch.tensor([1.0, 2.0]).to("cpu", non_blocking=True)  # made on the host: no device involved
        t + 1  # device work: nothing
    assert sum(probe.counts.values()) == 3, probe.counts
    assert all(where.startswith(__file__) for where in probe.counts)
