"""A step that runs out of memory is redone from the same batch at half the micro-batch (run/oom_retry.py),
tested with a real allocation failure: an address-space limit (RLIMIT_AS) between the peak of micro-batch
N/2 and that of N."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from recipe_runner import ROOT, SMOKE, read_metrics, run_command
from safetensors.torch import load_file

from lmpretrain.run.oom_retry import is_out_of_memory, smaller_micro_batch

WORKER = ROOT / "tests" / "oom_worker.py"
# Activations dominate: float64 logits of N x 128 x 8192. One thread and one malloc arena with a fixed mmap
# threshold, so that freed tensors leave the address space and the peaks are reproducible.
ARGS = [
    "--train.max_steps=2",
    "--data.seq_len=128",
    "--train.param_dtype=float64",
    "--run.threads=1",
    "--eval.every=0",
    "--eval.batches=1",
    "--eval.batch_size=2",
    "--eval.sample_tokens=0",
    "--checkpoint.every=0",
    "--logging.wandb_mode=disabled",
    "--optim.warmup_steps=1",
]
ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}


def _run(out: Path, micro: int, accum: int, limit: int = 0):
    argv = [str(SMOKE), f"--run.output_dir={out}", *ARGS]
    argv += [f"--train.micro_batch_size={micro}", f"--train.grad_accum_steps={accum}"]
    cmd = [sys.executable, str(WORKER), str(limit), json.dumps(argv)]
    done = run_command(cmd, out, env=ENV, timeout=600)
    peak = int(re.search(r"vm_peak=(\d+)", done.output).group(1))
    return done.output, peak, load_file(out / "final" / "model.safetensors")


def test_smaller_micro_batches_divide_the_old_one():
    assert [smaller_micro_batch(m) for m in (2, 3, 6, 8, 9, 15)] == [1, 1, 3, 4, 3, 5]
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8"))
    assert not is_out_of_memory(RuntimeError("shapes cannot be multiplied"))


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmPeak from /proc")
def test_a_step_out_of_memory_is_redone_at_half_the_micro_batch_on_the_same_batch(tmp_path, stdlib_cache):
    n = 16
    _, half_peak, reference = _run(tmp_path / "half", n // 2, 2)  # the run the halving must reproduce
    _, full_peak, _ = _run(tmp_path / "full", n, 1)
    assert full_peak - half_peak > 100e6, (half_peak, full_peak)  # activations dominate the address space
    limit = (half_peak + full_peak) // 2
    output, peak, weights = _run(tmp_path / "oom", n, 1, limit=limit)
    lines = [line for line in output.splitlines() if "out of memory (" in line]
    assert len(lines) == 1, output[-4000:]  # step 1 halves once; step 2 runs at the halved size
    assert "can't allocate memory" in lines[0]
    assert lines[0].endswith(
        f"micro-batch {n} -> {n // 2}, accumulation 1 -> 2; redoing this step from the same batch"
    )
    assert peak <= limit
    assert [r["step"] for r in read_metrics(tmp_path / "oom") if "train/loss" in r] == [1, 2]
    meta = json.loads(next((tmp_path / "oom").glob("checkpoints/*/meta.json")).read_text())
    assert (meta["config"]["train"]["micro_batch_size"], meta["config"]["train"]["grad_accum_steps"]) == (8, 2)
    assert weights.keys() == reference.keys()
    for name, value in weights.items():  # the same blocks, the same split: equal up to summation order
        torch.testing.assert_close(value, reference[name], rtol=1e-12, atol=1e-12, msg=name)
