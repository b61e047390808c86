"""train.profile_steps on CPU: a Chrome/Perfetto trace of exactly the chosen steps, holding their ops."""

import json

import pytest
import torch

import recipe_runner as rr
from lmpretrain.config import config_problems, load_config
from lmpretrain.observe.profiler import StepProfiler


def events(path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def train_steps(profiler: StepProfiler, steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    # fused, as the recipe's: the foreach path reads its step counter (a host tensor on a GPU) with item()
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    for n in range(1, steps + 1):
        profiler.step(n)
        model(torch.randn(4, 8)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_the_trace_holds_the_window_steps_and_their_ops(tmp_path):
    said = []
    with StepProfiler([2, 3], tmp_path / "profile", torch.device("cpu"), rank=0, say=said.append) as profiler:
        train_steps(profiler, 5)
    trace = tmp_path / "profile" / "trace-rank0-steps2-3.json"
    assert said == [
        "blocking host<->device transfers per step {2: 0, 3: 0}; where: {}",
        f"profile of steps 2-3: {trace}, {tmp_path / 'profile' / 'syncs-rank0-steps2-3.json'}",
    ]
    names = [e["name"] for e in events(trace)]
    assert [n for n in names if n.startswith("train step")] == ["train step 2", "train step 3"]
    assert names.count("aten::addmm") == 2  # one forward per step
    assert sum(n.startswith("Optimizer.step#AdamW") for n in names) == 2
    syncs = tmp_path / "profile" / "syncs-rank0-steps2-3.json"
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == [
        syncs.name,
        trace.name,
    ]  # no CUDA snapshot
    assert json.loads(syncs.read_text()) == {"per_step": {"2": 0, "3": 0}, "where": {}}  # nothing read back


def test_a_window_past_the_last_step_is_written_when_the_run_ends(tmp_path):
    with StepProfiler([3, 10], tmp_path, torch.device("cpu"), rank=1, say=lambda _: None) as profiler:
        train_steps(profiler, 4)
    names = [e["name"] for e in events(tmp_path / "trace-rank1-steps3-10.json")]
    assert [n for n in names if n.startswith("train step")] == ["train step 3", "train step 4"]


@pytest.mark.slow
def test_the_recipe_profiles_the_steps_it_is_asked_to(tmp_path):
    run = rr.run(
        tmp_path / "run",
        *rr.QUICK,
        "--train.max_steps=4",
        "--optim.warmup_steps=1",
        "--train.profile_steps=[2, 3]",
        "--logging.wandb_mode=disabled",
    )
    trace = tmp_path / "run" / "profile" / "trace-rank0-steps2-3.json"
    assert f"[lmpretrain] profile of steps 2-3: {trace}" in run.output
    names = [e["name"] for e in events(trace)]
    assert [n for n in names if n.startswith("train step")] == ["train step 2", "train step 3"]
    # forward, loss, backward and update of the model are in it
    for op in (
        "aten::scaled_dot_product_attention",
        "aten::cross_entropy_loss",
        "autograd::engine::evaluate_function: MmBackward0",
    ):
        assert op in names, op
    assert sum(n.startswith("Optimizer.step#AdamW") for n in names) == 2
    # Blocking transfers between host and device, by the probe the GPU check reads (scripts/gpu_check.sh):
    # the step's one readout, plus, in eager mode, transformers' check for packed sequences in the
    # position ids, once per micro-batch (masking_utils.find_packed_sequence_indices; skipped when compiled).
    syncs = json.loads((tmp_path / "run" / "profile" / "syncs-rank0-steps2-3.json").read_text())
    readout = [w for w in syncs["where"] if "/lmpretrain/run/step_readout.py:" in w]
    assert len(readout) == 1 and syncs["where"][readout[0]] == 2, syncs  # once per step
    others = {w: n for w, n in syncs["where"].items() if w not in readout}
    assert all("/transformers/masking_utils.py:" in w for w in others) and sum(others.values()) == 2 * 2, (
        syncs
    )
    assert syncs["per_step"] == {"2": 3, "3": 3}


def test_profile_steps_must_be_a_window():
    def problems(value):
        cfg = load_config([str(rr.SMOKE), f"--train.profile_steps={value}"])
        return [p for p in config_problems(cfg, 1) if "profile_steps" in p]

    assert problems("null") == [] and problems("[3, 3]") == [] and problems("[2, 5]") == []
    for bad in ("[5, 2]", "[0, 2]", "[4]"):
        assert problems(bad) == [
            f"train.profile_steps={bad} must be [start, end] with 1 <= start <= end, or null"
        ]
