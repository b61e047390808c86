"""Pre-flight on CUDA: plan the run on this GPU before the model is built, and stop a run whose planned peak
exceeds the device's memory, naming the micro-batch that fits (train.preflight_plan; CPU runs skip it).

The plan is `python -m lmpretrain.plan` of the very launch it guards: the resolved config as the run saves it
(precision, EMA, Muon/NorMuon, model.imports, a fork's own sections), the run's Layout written back as an
accelerate launch config (world size, machines, FSDP2/HSDP/DDP/DeepSpeed), and this GPU's entry of the GPU
table with its real memory. It runs in a CPU-only subprocess of the main process (the recipe's own process
group must not see the fake one); every rank gets the same verdict.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from lmpretrain.config import fork_sections, save_config
from lmpretrain.gpus import GPU, UNKNOWN, gpu_for_device
from lmpretrain.layout import Layout
from lmpretrain.plan.hardware import PlanError
from lmpretrain.plan.launch import launch_config
from lmpretrain.run.runtime import set_grad_accum


@dataclass(frozen=True)
class Device:
    """What the pre-flight needs of the GPU it runs on: its name (which picks its GPU table entry) and memory."""

    name: str
    memory_bytes: int

    @classmethod
    def current(cls) -> Device:
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return cls(props.name, props.total_memory)


def gpu_file(device: Device, layout: Layout) -> dict:
    """The plan's --gpu file: this device's entry of the GPU table (gpus.UNKNOWN's round figures for one the
    table lacks), with its real memory and the launch's GPUs per machine."""
    gpu = gpu_for_device(device.name) or UNKNOWN
    entry = {f.name: getattr(gpu, f.name) for f in dataclasses.fields(GPU) if f.name not in ("key", "match")}
    entry |= {"name": device.name, "memory_gib": device.memory_bytes / 2**30}
    entry["gpus_per_node"] = max(gpu.gpus_per_node, layout.ranks_per_machine)
    return {gpu.key: entry}


def plan_command(cfg, layout: Layout, device: Device, folder: Path) -> list[str]:
    """`python -m lmpretrain.plan` of this run on this device, its files written into `folder`."""
    save_config(cfg, folder / "config.yaml")
    (folder / "launch.yaml").write_text(yaml.safe_dump(launch_config(layout)))
    (folder / "gpu.yaml").write_text(yaml.safe_dump(gpu_file(device, layout)))
    command = [sys.executable, "-m", "lmpretrain.plan", str(folder / "config.yaml")]
    command += ["--config_file", str(folder / "launch.yaml"), "--gpu", str(folder / "gpu.yaml")]
    command += ["--json", str(folder / "plan.json")]
    if fork_sections(cfg):
        command += ["--sections", ",".join(fork_sections(cfg))]
    return command


def plan_here(cfg, layout: Layout, device: Device, folder: Path) -> dict:
    """The plan's numbers (its --json) of this run on `device`; RuntimeError with the planner's last line when
    it cannot be made. The subprocess sees no GPU and the modules this process can import (model.imports)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(plan_command(cfg, layout, device, folder), env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError((done.stderr.strip().splitlines() or ["no output"])[-1])
    return json.loads((folder / "plan.json").read_text())


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
        else no_fit_hint(plan)
    )
    return (
        f"the plan of this run peaks at {_size(peak)} per GPU, more than this GPU's {_size(memory_bytes)} "
        f"(python -m lmpretrain.plan shows where): {fix}; train.preflight_plan=false skips this check"
    )


def no_fit_hint(plan: dict) -> str:
    """What a plan (its --json) in which no micro-batch fits says to change: its cheapest planned way to fit."""
    options = plan.get("fit_options") or []
    if not options:
        return (
            "no micro-batch fits, nor with full activation checkpointing or more shards: shorten data.seq_len"
        )
    best = options[0]
    return (
        f"no micro-batch fits; the cheapest planned way to fit is {best['change']} "
        f"({best['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU on {best['num_processes']} GPUs)"
    )


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_plan_fits(cfg, info, accelerator, say, device: Device | None = None) -> None:
    """On CUDA with train.preflight_plan: plan, say the planned peak, and stop (every rank) if it cannot fit;
    train.micro_batch_size=auto takes the plan's largest micro-batch that divides the rows per step.
    `device`: the GPU to plan for, where this process has none (tests); default: this CUDA device."""
    if not cfg.train.preflight_plan or (device is None and accelerator.device.type != "cuda"):
        return
    from accelerate.utils import broadcast_object_list

    from lmpretrain.plan.planner import batch_split  # the simulator's imports only where a plan is made

    result: list = [None, None, None, None]
    if accelerator.is_main_process:
        device = device or Device.current()
        try:
            with tempfile.TemporaryDirectory() as folder:
                plan = plan_here(cfg, info.layout, device, Path(folder))
            rows = cfg.global_batch(info.world_size) // info.world_size
            split = batch_split(rows, plan["max_micro_batch"])
            peak, problem = plan["per_rank_bytes"]["total_peak"], verdict(plan, device.memory_bytes, cfg)
            result = [peak, problem, split, no_fit_hint(plan)]
        except (
            PlanError,
            RuntimeError,
            OSError,
            ValueError,
        ) as err:  # a plan that cannot be made must not stop a run
            result = [None, f"skipped ({err})", None, None]
    broadcast_object_list(result)
    peak, problem, split, hint = result
    if cfg.train.micro_batch_size == "auto":
        if split is None:
            raise PlanError(f"train.micro_batch_size=auto: {problem or hint}")
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
    say(f"memory plan: peak {_size(peak)} per GPU (python -m lmpretrain.plan); it fits")
