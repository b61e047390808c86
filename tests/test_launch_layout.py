"""The launch described once (lmpretrain/layout.py): what each kind says on the start-up line, the groups
that span machines, the layouts that cannot be, the launch config it is written back as for the pre-flight's
plan, and the one the recipe reads from its Accelerator."""

from __future__ import annotations

import pytest
import yaml
from accelerate import Accelerator

from lmpretrain.layout import Layout
from lmpretrain.plan.hardware import PlanError
from lmpretrain.plan.launch import launch_config, read_launch
from lmpretrain.run.runtime import layout_of

LAYOUTS = {
    "none": Layout(),
    "ddp (replicated)": Layout("ddp", 8),
    "fsdp2": Layout("fsdp2", 16, 2, reshard_after_forward=False),
    "fsdp2 HSDP: 8 replica groups x 8 shards (parallelism_config)": Layout("fsdp2", 64, 8, replicas=8),
    "deepspeed-zero1": Layout("deepspeed", 2, zero_stage=1),
    "deepspeed-zero2": Layout("deepspeed", 4, zero_stage=2),
}


@pytest.mark.parametrize("words", LAYOUTS)
def test_each_layout_says_what_it_is_and_is_written_back_as_the_launch_config_it_came_from(words, tmp_path):
    layout = LAYOUTS[words]
    assert layout.describe() == words
    path = tmp_path / "launch.yaml"
    path.write_text(yaml.safe_dump(launch_config(layout)))
    assert read_launch(str(path), None, None) == layout


def test_shards_replicas_and_the_groups_that_span_machines():
    hsdp = Layout("fsdp2", 64, 8, replicas=8)
    assert (hsdp.hsdp, hsdp.shards, hsdp.ranks_per_machine, hsdp.replicated) == (True, 8, 8, False)
    assert not hsdp.spans_machines(hsdp.shards)  # a shard group: 8 consecutive ranks, one machine
    assert hsdp.spans_machines(hsdp.replicas, hsdp.shards)  # a replica group: ranks 0, 8, ..., 56
    assert hsdp.spans_machines(64) and not Layout("ddp", 8).spans_machines(8)
    assert Layout("ddp", 8, 2).spans_machines(8)  # 4 GPUs on each of 2 machines
    assert Layout("ddp", 8).shards == 1 and Layout("ddp", 8).replicated and Layout("fsdp2", 8).shards == 8
    assert Layout("fsdp2", 16, 2, replicas=8).spans_machines(8, 2)  # replicas 2 apart: ranks 0..14
    assert Layout(experts=1, tensor_parallel=1) == Layout()  # the degrees a later launch may set
    assert Layout("fsdp2", 8, experts=2).describe() == "fsdp2, experts over 2 ranks"


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"num_processes": 0}, "num_processes=0"),
        ({"kind": "ddp", "num_processes": 8, "num_machines": -1}, "num_machines=-1"),
        ({"kind": "zero3"}, "kind='zero3' (one of none, ddp, fsdp1, fsdp2, deepspeed)"),
        (
            {"kind": "ddp", "num_processes": 8, "replicas": 2},
            "replicas=2: replica groups of shards are FSDP2's",
        ),
        ({"kind": "fsdp2", "num_processes": 6, "replicas": 4}, "replicas=4 x tensor_parallel=1 must divide"),
        ({"kind": "deepspeed", "num_processes": 2}, "zero_stage=0 with kind=deepspeed"),
        ({"kind": "none", "num_processes": 2}, "kind=none with 2 processes"),
    ],
)
def test_a_layout_that_cannot_be_is_refused(fields, problem):
    with pytest.raises(ValueError, match="not a launch layout") as err:
        Layout(**fields)
    assert problem in str(err.value)


def test_fsdp1_is_not_written_for_the_planner_and_one_process_reads_as_none():
    with pytest.raises(
        PlanError, match="the planner plans FSDP2, DDP and DeepSpeed ZeRO-1/2 launches, not fsdp1"
    ):
        launch_config(Layout("fsdp1", 2))
    assert layout_of(Accelerator(cpu=True)) == Layout()  # this test process: one process, no wrapping
