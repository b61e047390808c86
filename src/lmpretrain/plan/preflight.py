"""Pre-flight on CUDA: plan the run on this GPU before the model is built, and stop a run whose planned peak
exceeds the device's memory, naming the micro-batch that fits (train.preflight_plan; CPU runs skip it).

The plan runs in a CPU-only subprocess on the main process (the recipe's own process group must not see the
fake one), from the resolved config as the run saves it; every rank gets the same verdict.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from lmpretrain.config import save_config
from lmpretrain.plan.hardware import PlanError
from lmpretrain.run.runtime import set_grad_accum

_LAUNCH = {"fsdp2": "FSDP", "deepspeed-zero1": "DEEPSPEED", "deepspeed-zero2": "DEEPSPEED"}


def verdict(plan: dict, memory_bytes: float, cfg) -> str | None:
    """The refusal for a plan (its --json) on a device of `memory_bytes`, or None when its peak fits."""
    peak = plan["per_rank_bytes"]["total_peak"]
    if peak <= memory_bytes:
        return None
    fits = plan["max_micro_batch"]
    if cfg.train.micro_batch_size == "auto":  # the caller picks the micro-batch, or says none fits
        return None
    rows = cfg.train.micro_batch_size * cfg.train.grad_accum_steps
    split = next((m for m in range(min(fits, rows), 0, -1) if rows % m == 0), None)
    fix = (
        f"--train.micro_batch_size={split} --train.grad_accum_steps={rows // split} keeps the global batch"
        if split
        else "no micro-batch fits: shard with FSDP2, set train.activation_checkpointing=true or shorten data.seq_len"
    )
    return (
        f"the plan of this run peaks at {peak / 2**30:.1f} GiB per GPU, more than this GPU's "
        f"{memory_bytes / 2**30:.1f} GiB (python -m lmpretrain.plan shows where): {fix}; "
        "train.preflight_plan=false skips this check"
    )


def _plan_here(cfg, sharding: str, world: int, local_world: int, folder: Path) -> dict:
    import torch

    from lmpretrain.observe.flops import table_peak

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    gpu = {
        "this": {
            "name": props.name,
            "memory_gib": props.total_memory / 2**30,
            "bf16_tflops": (table_peak(props.name, "bf16") or 989.4e12) / 1e12,
            "fp8_tflops": None,
            "hbm_gbps": 3350,  # timing is not what this check is for
            "intra_node_gbps": 450,
            "inter_node_gbps": 50,
            "gpus_per_node": local_world,
        }
    }
    kind = sharding.split()[0]
    launch = {
        "distributed_type": _LAUNCH.get(kind, "MULTI_GPU" if world > 1 else "NO"),
        "num_processes": world,
    }
    launch["num_machines"] = max(1, world // local_world)
    if kind == "fsdp2":
        reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() not in ("false", "0")
        launch["fsdp_config"] = {"fsdp_version": 2, "fsdp_reshard_after_forward": reshard}
    elif kind.startswith("deepspeed"):
        launch["deepspeed_config"] = {"zero_stage": int(kind[-1])}
    save_config(cfg, folder / "config.yaml")
    (folder / "gpu.yaml").write_text(yaml.safe_dump(gpu))
    (folder / "launch.yaml").write_text(yaml.safe_dump(launch))
    command = [sys.executable, "-m", "lmpretrain.plan", str(folder / "config.yaml"), "--config_file"]
    command += [
        str(folder / "launch.yaml"),
        "--gpu",
        str(folder / "gpu.yaml"),
        "--json",
        str(folder / "plan.json"),
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the plan simulates on the CPU
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError((done.stderr.strip().splitlines() or ["no output"])[-1])
    return json.loads((folder / "plan.json").read_text())


def check_plan_fits(cfg, info, accelerator, say) -> None:
    """On CUDA with train.preflight_plan: plan, say the planned peak, and stop (every rank) if it cannot fit;
    train.micro_batch_size=auto takes the plan's largest micro-batch that divides the rows per step."""
    if accelerator.device.type != "cuda" or not cfg.train.preflight_plan:
        return
    import torch
    from accelerate.utils import broadcast_object_list

    from lmpretrain.plan.planner import batch_split  # the simulator's imports only where a plan is made

    result: list = [None, None, None]
    if accelerator.is_main_process:
        try:
            with tempfile.TemporaryDirectory() as folder:
                plan = _plan_here(cfg, info.sharding, info.world_size, info.local_world_size, Path(folder))
            memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            rows = cfg.global_batch(info.world_size) // info.world_size
            split = batch_split(rows, plan["max_micro_batch"])
            result = [plan["per_rank_bytes"]["total_peak"], verdict(plan, memory, cfg), split]
        except (RuntimeError, OSError, ValueError) as err:  # a plan that cannot be made must not stop a run
            result = [None, f"skipped ({err})", None]
    broadcast_object_list(result)
    peak, problem, split = result
    if cfg.train.micro_batch_size == "auto":
        if split is None:
            raise PlanError(
                f"train.micro_batch_size=auto: {problem or 'no micro-batch fits this GPU'}; shard with FSDP2, set "
                "train.activation_checkpointing=true or shorten data.seq_len"
            )
        cfg.train.micro_batch_size, cfg.train.grad_accum_steps = split
        set_grad_accum(accelerator, split[1])
        say(
            f"train.micro_batch_size=auto: {split[0]} x {split[1]} accumulation x {info.world_size} processes = "
            f"global batch {cfg.global_batch(info.world_size)} (the largest micro-batch the plan fits in 0.9 of "
            "this GPU's memory)"
        )
        return
    if peak is None:
        say(f"memory plan: {problem}")
        return
    if problem:
        raise PlanError(problem)
    say(f"memory plan: peak {peak / 2**30:.1f} GiB per GPU (python -m lmpretrain.plan); it fits")
