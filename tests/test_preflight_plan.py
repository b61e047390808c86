"""The CUDA pre-flight (plan/preflight.py) on this CPU, for a GPU described by name and memory: it plans the very
launch it guards (the same numbers as `python -m lmpretrain.plan` of that launch: 1 process with a fork's own
model and config section, FSDP2, HSDP; with bf16, NorMuon and EMA), and `check_plan_fits` refuses a run that
cannot fit with one message naming the split that does, and passes one that fits. The plan runs as on a GPU
machine: `python -m lmpretrain.plan` in a CPU subprocess, from the files the pre-flight writes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from accelerate import Accelerator

from lmpretrain.config import load_config
from lmpretrain.layout import Layout
from lmpretrain.plan.__main__ import main
from lmpretrain.plan.hardware import PlanError, load_gpu
from lmpretrain.plan.launch import launch_config, read_launch
from lmpretrain.plan.planner import make_plan
from lmpretrain.plan.preflight import Device, check_plan_fits, gpu_file, plan_here
from lmpretrain.run.runtime import RuntimeInfo

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
H100 = Device("NVIDIA H100 80GB HBM3", int(load_gpu("h100").memory_bytes))


@dataclass
class MTPConfig:  # a fork's own config section (tests/forks/pretrain_mtp.py has one of this shape)
    weight: float = 0.1


def fork_config(tmp_path: Path) -> Path:
    """smoke.yaml with a fork's model (tests/forks/tinyblock.py, through model.imports) and section."""
    path = tmp_path / "fork.yaml"
    path.write_text(
        f"base: {SMOKE}\n"
        "model:\n"
        "  type: tinyblock\n"
        f"  imports: [{ROOT / 'tests' / 'forks' / 'tinyblock.py'}]\n"
        "  overrides: {hidden_size: 32, num_attention_heads: 2, intermediate_size: null,\n"
        "              num_key_value_heads: null, max_position_embeddings: null, tie_word_embeddings: null}\n"
        "mtp: {weight: 0.3}\n"
    )
    return path


def direct(config: Path, launch: str | None, world: int, tmp_path: Path, *args: str) -> dict:
    """`python -m lmpretrain.plan` of the launch (in this process: its main), as a user runs it; its --json."""
    out = tmp_path / "direct.json"
    launch_args = ["--config_file", str(ROOT / "configs" / "accelerate" / launch)] if launch else []
    argv = [
        str(config),
        *launch_args,
        "--num_processes",
        str(world),
        "--gpu",
        "h100",
        "--json",
        str(out),
        *args,
    ]
    assert main(argv) == 0
    return json.loads(out.read_text())


RUN = ["--train.precision=bf16", "--optim.name=normuon", "--train.ema_decay=0.99"]


@pytest.mark.parametrize(
    "launch, world",
    [
        (None, 1),
        pytest.param("cpu-fsdp.yaml", 2, marks=pytest.mark.slow),
        pytest.param("cpu-hsdp.yaml", 4, marks=pytest.mark.slow),
    ],
)
def test_the_preflight_plans_the_launch_it_guards(launch, world, tmp_path):
    """The pre-flight's plan of a launch (its layout as the planner reads that launch config, this H100) equals
    the direct plan of the same launch, number for number; 1 process: a fork's model (model.imports) and
    config section, which once made the plan exit 2, so the pre-flight skipped them."""
    layout = read_launch(str(ROOT / "configs" / "accelerate" / launch) if launch else None, world, None)
    assert (
        read_launch_of(layout, tmp_path) == layout
    )  # the launch config the pre-flight writes reads back as it
    if launch is None:
        config, run, extra = fork_config(tmp_path), [], ["--sections", "mtp"]
        cfg = load_config([str(config)], sections={"mtp": MTPConfig})
    else:
        config, run, extra = SMOKE, RUN, []
        cfg = load_config([str(SMOKE), *RUN])
    (tmp_path / "preflight").mkdir()
    here = plan_here(cfg, layout, H100, tmp_path / "preflight")
    assert here == direct(config, launch, world, tmp_path, *run, *extra)
    assert (here["world_size"], here["replica_groups"]) == (world, 2 if launch == "cpu-hsdp.yaml" else 1)
    assert here["per_rank_bytes"]["total_peak"] > 0 and here["max_micro_batch"] > 0


def read_launch_of(layout: Layout, tmp_path: Path) -> Layout:
    path = tmp_path / "written-launch.yaml"
    path.write_text(json.dumps(launch_config(layout)))  # JSON is YAML
    return read_launch(str(path), None, None)


def test_the_preflight_describes_its_gpu_from_the_one_table():
    """This GPU's entry of the GPU table with the device's own memory; a GPU the table lacks: round figures."""
    layout = Layout("ddp", 2)
    ((key, entry),) = gpu_file(H100, layout).items()
    assert key == "h100" and entry["bf16_tflops"] == 989.4 and entry["fp8_tflops"] == 1978.9
    assert entry["memory_gib"] == pytest.approx(79.1) and entry["name"] == H100.name
    odd = gpu_file(Device("NVIDIA RTX PRO 6000", 96 * 2**30), layout)
    assert list(odd) == ["unknown"] and odd["unknown"]["memory_gib"] == 96
    assert gpu_file(H100, Layout("ddp", 16))["h100"]["gpus_per_node"] == 16  # a launch of 16 on one machine


def test_a_launch_the_planner_cannot_plan_is_said_and_not_stopped():
    """FSDP1 (which the recipe launches on GPUs, the planner does not plan): the run goes on, saying why."""
    said = []
    info = RuntimeInfo(Layout("fsdp1", 2), 0, "FSDP", None, "cpu", 1)
    check_plan_fits(load_config([str(SMOKE)]), info, Accelerator(cpu=True), said.append, device=H100)
    assert said == [
        "memory plan: skipped (the planner plans FSDP2, DDP and DeepSpeed ZeRO-1/2 launches, not fsdp1)"
    ]


@pytest.mark.slow
def test_check_plan_fits_refuses_with_one_message_and_passes(tmp_path):
    """On a GPU too small for micro-batches of 4 (smoke.yaml: 4 x 2 accumulation) the run stops before any
    work with one message naming the split that fits and keeps the global batch; on an 80 GB H100 it says the
    planned peak and goes on."""
    cfg = load_config([str(SMOKE)])
    plan = make_plan(cfg, Layout(), load_gpu("h100"))
    fixed, per_row = plan.step.micro_batch_peak - plan.step.row_bytes, plan.step.row_bytes / 4
    small = Device(H100.name, int((fixed + 2.5 * per_row) / 0.9))  # 2 rows fit in 0.9 of it, not 3
    assert plan.step.total_peak > small.memory_bytes
    accelerator, said = Accelerator(cpu=True), []
    info = RuntimeInfo(Layout(), 0, "NO", None, "cpu", 1)
    with pytest.raises(PlanError) as refused:
        check_plan_fits(cfg, info, accelerator, said.append, device=small)
    message = str(refused.value)
    assert message.startswith(f"the plan of this run peaks at {plan.step.total_peak / 2**20:.1f} MiB per GPU")
    assert "--train.micro_batch_size=2 --train.grad_accum_steps=4 keeps the global batch" in message
    assert "\n" not in message and said == []
    check_plan_fits(cfg, info, accelerator, said.append, device=H100)
    assert said == [
        f"memory plan: peak {plan.step.total_peak / 2**20:.1f} MiB per GPU (python -m lmpretrain.plan); it fits"
    ]
