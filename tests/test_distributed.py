"""Data parallelism through accelerate changes nothing but speed; degraded launches are refused.

Every run here is a real `accelerate launch` of recipes/pretrain.py with real gloo processes.
Parameters are float64 so that a real normalisation bug is not hidden by fp32 summation-order noise
(which Adam amplifies to ~1e-5 relative after 10 steps).
"""

import subprocess

import pytest
import yaml

import recipe_runner as rr
from lmpretrain.observe.tracking import read_jsonl

pytestmark = pytest.mark.slow  # end-to-end: launches the recipe in subprocesses

EXACT = rr.EXACT


def assert_equivalent(a: rr.Run, b: rr.Run):
    for x, y in zip(a.metrics(), b.metrics(), strict=True):
        assert x.keys() == y.keys(), x["step"]
        for key in (
            "train/loss",
            "train/grad_norm",
            "eval/loss",
            "eval/loss_se",
            "eval/bpb_se",
            "eval/tokens",
        ):
            assert x.get(key, 0.0) == pytest.approx(y.get(key, 0.0), rel=1e-6), (key, x["step"])
    # the per-block losses come back from the ranks in block order
    blocks_a, blocks_b = (read_jsonl(run.out / "eval_blocks.jsonl") for run in (a, b))
    assert [r["step"] for r in blocks_a] == [r["step"] for r in blocks_b] == [0, 5, 10]
    for x, y in zip(blocks_a, blocks_b, strict=True):
        assert x["targets"] == y["targets"] and x["bytes"] == y["bytes"] and len(x["loss"]) == 24
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6)
    assert rr.rel_diff(a.weights(), b.weights()) < 1e-6


@pytest.mark.parametrize("accum", [1, 2])
def test_two_ranks_equal_one_rank_with_twice_the_micro_batch(tmp_path, two_ranks_accum2, accum):
    if accum == 2:
        two = two_ranks_accum2
    else:
        two = rr.run(
            tmp_path / "two",
            *EXACT,
            "--train.micro_batch_size=4",
            "--train.grad_accum_steps=1",
            launch="cpu-ddp",
        )
    one = rr.run(
        tmp_path / "one",
        *EXACT,
        f"--train.micro_batch_size={8 // accum}",
        f"--train.grad_accum_steps={accum}",
        launch="cpu",
    )
    assert "world_size=2 distributed_type=MULTI_CPU backend=gloo" in two.output
    assert (
        "model init: on the host (ddp: rank 0 builds it, its wrapping broadcasts it; the other ranks build on meta)"
        in two.output
    )
    assert "world_size=1 distributed_type=NO" in one.output
    assert "DDP: every rank holds all 616,768 parameter values" in two.output
    # DeepSpeed is imported only by DeepSpeed launches (test_deepspeed sees its banner there).
    assert "Setting accelerator to CPU" not in two.output + one.output
    assert_equivalent(two, one)


def test_two_machines_on_localhost_equal_one_machine(tmp_path, two_ranks_accum2):
    port = str(rr.free_port())
    out = tmp_path / "multinode"
    procs = []
    for machine in (0, 1):
        cmd = rr.command(
            out,
            *EXACT,
            "--train.micro_batch_size=2",
            "--train.grad_accum_steps=2",
            "--run.threads=1",
            launch="cpu-ddp",
            launch_args=[
                "--num_machines",
                "2",
                "--num_processes",
                "2",
                "--machine_rank",
                str(machine),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                port,
            ],
        )
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=rr.ROOT,
                env=rr.env_for_runs(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "world_size=2 distributed_type=MULTI_CPU backend=gloo" in outputs[0]
    multinode = rr.Run(out, 0, outputs[0])
    assert_equivalent(multinode, two_ranks_accum2)


def refused(tmp_path, launch_args, config=None) -> str:
    cmd = [
        str(rr.ACCELERATE),
        "launch",
        *(["--config_file", str(config)] if config else []),
        *launch_args,
        "--main_process_port",
        str(rr.free_port()),
        str(rr.RECIPE),
        str(rr.SMOKE),
        f"--run.output_dir={tmp_path / 'run'}",
        "--logging.wandb_mode=disabled",
    ]
    proc = subprocess.run(
        cmd,
        cwd=rr.ROOT,
        env=rr.env_for_runs(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "pretrain:" not in proc.stdout and not (tmp_path / "run" / "metrics.jsonl").exists()
    return proc.stdout


def test_cpu_flag_with_two_processes_is_refused(tmp_path):
    out = refused(tmp_path, ["--cpu", "--num_processes", "2"])
    assert "accelerate launch asked for 2 processes but 1 started" in out
    assert "configs/accelerate/cpu-ddp.yaml" in out


def test_multi_cpu_config_is_refused(tmp_path):
    config = tmp_path / "multi-cpu.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "compute_environment": "LOCAL_MACHINE",
                "distributed_type": "MULTI_CPU",
                "num_processes": 2,
                "num_machines": 1,
                "machine_rank": 0,
                "use_cpu": True,
                "mixed_precision": "no",
            }
        )
    )
    assert "asked for 2 processes but 1 started" in refused(tmp_path, [], config)


def test_fsdp1_on_cpu_is_refused(tmp_path):
    """FSDP2 runs on CPU (test_fsdp.py); FSDP1 would not, and is refused instead of run as DDP."""
    out = refused(tmp_path, ["--fsdp_version", "1"], rr.ROOT / "configs" / "accelerate" / "cpu-fsdp.yaml")
    assert "asks for FSDP version 1 on CPU; only FSDP2 runs on CPU" in out


def test_plain_multi_gpu_flag_on_cpu_becomes_one_gloo_group(tmp_path):
    """The launch that starts two unsynchronised copies with a stock Accelerator() is a real group here."""
    cmd = [
        str(rr.ACCELERATE),
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--main_process_port",
        str(rr.free_port()),
        str(rr.RECIPE),
        str(rr.SMOKE),
        f"--run.output_dir={tmp_path / 'run'}",
        *rr.QUICK,
        "--train.max_steps=6",
        "--eval.every=0",
        "--logging.wandb_mode=disabled",
    ]
    proc = subprocess.run(
        cmd,
        cwd=rr.ROOT,
        env=rr.env_for_runs(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "world_size=2 distributed_type=MULTI_CPU backend=gloo" in proc.stdout
    assert proc.stdout.count("parameter sha256 per rank") == 1
