"""The micro-batch: train.global_batch_size (grad_accum_steps derived), train.micro_batch_size=auto (the
CUDA pre-flight plan's pick; refused elsewhere), and a step that runs out of memory redone from the same
batch at half the micro-batch (run/oom_retry.py), tested with a real allocation failure: an address-space
limit (RLIMIT_AS) between the peak of micro-batch N/2 and that of N."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmpretrain.config import config_problems, derive_accumulation, load_config
from lmpretrain.layout import Layout
from lmpretrain.plan.hardware import load_gpu
from lmpretrain.plan.planner import make_plan
from lmpretrain.run.oom_retry import is_out_of_memory, smaller_micro_batch
from recipe_runner import ROOT, SMOKE, read_metrics, run_command

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


def _run(out: Path, micro: int, accum: int, limit: int = 0, batch: str = "--train.grad_accum_steps"):
    argv = [str(SMOKE), f"--run.output_dir={out}", *ARGS]
    argv += [f"--train.micro_batch_size={micro}", f"{batch}={accum}"]
    cmd = [sys.executable, str(WORKER), str(limit), json.dumps(argv)]
    done = run_command(cmd, out, env=ENV, timeout=600)
    peak = int(re.search(r"vm_peak=(\d+)", done.output).group(1))
    return done.output, peak, load_file(out / "final" / "model.safetensors")


def test_global_batch_size_derives_the_accumulation_or_names_the_micro_batch_that_divides_it():
    cfg = load_config([str(SMOKE), "--train.global_batch_size=48", "--train.grad_accum_steps=5"])
    assert config_problems(cfg, 2) == []
    derive_accumulation(cfg.train, 2)
    assert (cfg.train.micro_batch_size, cfg.train.grad_accum_steps, cfg.global_batch(2)) == (4, 6, 48)
    cfg = load_config([str(SMOKE), "--train.global_batch_size=36"])
    assert config_problems(cfg, 2) == [
        "train.global_batch_size=36 is not a multiple of train.micro_batch_size x world size = 4 x 2: "
        "set --train.micro_batch_size=3 (or a global batch that divides)"
    ]
    auto = load_config([str(SMOKE), "--train.micro_batch_size=auto"])
    assert config_problems(auto, 1) == [
        "train.micro_batch_size=auto picks the micro-batch for a stated global batch: set train.global_batch_size"
    ]


def test_the_plan_of_auto_is_the_largest_micro_batch_that_fits_and_divides():
    """What the CUDA pre-flight takes for train.micro_batch_size=auto: the plan's split of the rows per rank."""
    cfg = load_config([str(SMOKE), "--train.micro_batch_size=auto", "--train.global_batch_size=96"])
    gpu = load_gpu("h100")
    plan = make_plan(cfg, Layout("ddp", 2, 1), gpu)
    assert plan.max_micro_batch > 48 and plan.split == (48, 1)  # a tiny model: all 48 rows per rank fit
    tight = make_plan(
        cfg,
        Layout("ddp", 2, 1),
        gpu,
        memory_fraction=(plan.step.total_peak + 2.5 * plan.step.row_bytes) / gpu.memory_bytes,
    )
    assert tight.max_micro_batch in (3, 4) and tight.split == (
        tight.max_micro_batch,
        48 // tight.max_micro_batch,
    )
    assert any("micro_batch_size=auto" in note for note in plan.notes)


@pytest.mark.slow
def test_auto_is_refused_without_cuda_in_the_preflight(tmp_path, stdlib_cache):
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs auto")
    argv = [str(SMOKE), f"--run.output_dir={tmp_path}", "--train.micro_batch_size=auto"]
    argv += ["--train.global_batch_size=16", "--logging.wandb_mode=disabled"]
    done = run_command([sys.executable, str(ROOT / "recipes" / "pretrain.py"), *argv], tmp_path, check=False)
    assert done.returncode == 2, done.output[-3000:]
    assert (
        "train.micro_batch_size=auto cannot run here (it is the largest micro-batch the plan fits in a GPU's "
        "memory, and this machine has no CUDA GPU)" in done.output
    )
    assert "Traceback" not in done.output and not (tmp_path / "config.yaml").exists()


def test_smaller_micro_batches_divide_the_old_one():
    assert [smaller_micro_batch(m) for m in (2, 3, 6, 8, 9, 15)] == [1, 1, 3, 4, 3, 5]
    assert is_out_of_memory(
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8")
    )
    assert not is_out_of_memory(RuntimeError("shapes cannot be multiplied"))


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmPeak from /proc")
def test_a_step_out_of_memory_is_redone_at_half_the_micro_batch_on_the_same_batch(tmp_path, stdlib_cache):
    n = 16
    # The run the halving must reproduce, its accumulation (2) derived from the global batch it states.
    _, half_peak, reference = _run(tmp_path / "half", n // 2, n, batch="--train.global_batch_size")
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
    for run in ("oom", "half"):
        train = json.loads(next((tmp_path / run).glob("checkpoints/*/meta.json")).read_text())["config"][
            "train"
        ]
        assert (train["micro_batch_size"], train["grad_accum_steps"]) == (8, 2), run
    assert weights.keys() == reference.keys()
    for name, value in weights.items():  # the same blocks, the same split: equal up to summation order
        torch.testing.assert_close(value, reference[name], rtol=1e-12, atol=1e-12, msg=name)
