"""train.fp8 on CPU: which layers of llama-1b (built on the meta device) would be float8, and the one
message that refuses fp8 where it cannot run (no CUDA here) or without compile."""

import math
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from lmpretrain.config import config_problems, load_config
from lmpretrain.model.build import build_model, build_model_config
from lmpretrain.model.fp8 import after_each_step, converted_modules, large_enough
from lmpretrain.model.precision import MixedPrecision
from lmpretrain.model.speed import kernel_problems

LLAMA_1B = str(Path(__file__).resolve().parents[1] / "configs" / "llama-1b.yaml")
BLOCK = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama_1b_on_meta():
    with torch.device("meta"):
        return build_model(build_model_config(load_config([LLAMA_1B]).model))


def test_tensorwise_converts_every_projection_of_every_block_and_never_the_head():
    model = llama_1b_on_meta()
    names = converted_modules(model, "tensorwise")
    # hidden 2048, 8 KV heads of 64: q/o 2048x2048, k/v 2048->512, gate/up 2048->8192, down 8192->2048
    assert names == [
        f"model.layers.{i}.{kind}.{p}"
        for i in range(16)
        for kind, p in [("self_attn", p) for p in BLOCK[:4]] + [("mlp", p) for p in BLOCK[4:]]
    ]
    assert "lm_head" not in names and model.lm_head.out_features == 49152  # large, but the head: never


def test_rowwise_converts_only_the_down_projections():
    """Rowwise's casts cost more: of llama-1b's shapes only 8192 -> 2048 is large enough."""
    assert converted_modules(llama_1b_on_meta(), "rowwise") == [
        f"model.layers.{i}.mlp.down_proj" for i in range(16)
    ]


def test_the_size_rule():
    assert not large_enough("tensorwise", 1024, 4096) and large_enough("tensorwise", 1040, 256)
    assert large_enough("tensorwise", 256, 4112) and not large_enough("tensorwise", 2040, 2048)  # 2040 % 16
    assert not large_enough("rowwise", 2048, 8192) and large_enough("rowwise", 4112, 2048)
    assert not large_enough("rowwise", 8192, 1024) and large_enough("rowwise", 4096, 2064)


def test_fp8_is_refused_without_cuda_and_without_compile():
    cfg = load_config([LLAMA_1B, "--train.fp8=tensorwise"])
    problems = kernel_problems(cfg, build_model_config(cfg.model))
    if torch.cuda.is_available():  # the probe the check asks: on a GPU the device decides
        assert len(problems) <= 1 and all("compute capability >= 8.9" in p for p in problems)
    else:
        assert problems == [
            "train.fp8=tensorwise needs a CUDA GPU of compute capability >= 8.9 (H100/H200, L4, RTX 4090) and "
            "torchao; there is no CUDA device here. Use train.fp8=none (bf16)"
        ]
    cfg = load_config([LLAMA_1B, "--train.fp8=rowwise", "--train.compile=false"])
    assert any("train.fp8=rowwise needs train.compile=true" in p for p in config_problems(cfg, 8))
    assert not any("fp8" in p for p in config_problems(load_config([LLAMA_1B, "--train.fp8=rowwise"]), 8))


# Two gloo ranks, FSDP2 over two float8 (tensorwise, float8 all-gather) Linear layers. Gloo cannot all-gather
# float8, so no forward runs: each rank sets its gradient shards by hand (as backward would) and steps.
PRECOMPUTE = textwrap.dedent("""
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_utils import amax_to_scale
    from lmpretrain.model.fp8 import precompute_fp8_scales

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32, bias=False), nn.Linear(32, 64, bias=False))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    for layer in model:
        fully_shard(layer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    print("said:", precompute_fp8_scales(model, optimizer, "tensorwise"))
    print("none:", precompute_fp8_scales(model, optimizer, "none"))

    def scales():
        return [getattr(p._local_tensor, "_precomputed_scale", None) for p in model.parameters()]

    def expected():  # torchao's tensorwise scale of each whole weight (every rank's shard): its amax_to_scale
        return [amax_to_scale(p.full_tensor().abs().max(), torch.float8_e4m3fn) for p in model.parameters()]

    print("before any step:", scales())
    for step in range(2):
        torch.manual_seed(10 + step + 100 * rank)  # each rank's own gradient shards
        for p in model.parameters():
            p.grad = torch.distributed.tensor.DTensor.from_local(
                torch.randn(p.to_local().shape), p.device_mesh, p.placements
            )
        amax_before = [p.full_tensor().abs().max().item() for p in model.parameters()]
        optimizer.step()
        got, want = scales(), expected()
        moved = [p.full_tensor().abs().max().item() != a for p, a in zip(model.parameters(), amax_before)]
        print(f"step {step}: moved {moved} match", all(torch.equal(g, w) for g, w in zip(got, want)))
""")


@pytest.mark.slow  # 2 processes
def test_fsdp2_float8_scales_are_precomputed_after_each_optimizer_step():
    """Needs torchao (pip install -e .[gpu]): not in requirements.txt, since transformers imports it whenever
    it is installed and, with a CPU torch, it prints warnings about its CUDA libraries at every start."""
    pytest.importorskip("torchao")
    from recipe_runner import launch_ranks

    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "precompute.py"
        script.write_text(PRECOMPUTE)
        outputs = launch_ranks(script)
    for out in outputs:
        assert 'said: ["fp8: the float8 scales of 2 FSDP2-sharded weights are computed after each' in out, out
        assert "none: []" in out and "before any step: [None, None]" in out, out
        assert (
            "step 0: moved [True, True] match True" in out and "step 1: moved [True, True] match True" in out
        ), out


def test_the_scale_precompute_runs_after_each_optimizer_step_that_ran():
    """What precompute_fp8_scales hangs torchao's precompute on, with the recipe's update path: it sees the
    updated weights, and runs after no skipped step (fp16's overflow, the guard's skip)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    seen = []
    after_each_step(optimizer, lambda: seen.append(model.weight.detach().clone()))
    precision = MixedPrecision("fp16", torch.device("cpu"), init_scale=1.0)

    def step(skip=False, overflow=False):
        with precision.autocast():
            loss = model(torch.randn(2, 4)).float().square().sum() * (math.inf if overflow else 1)
        precision.scale(loss).backward()
        precision.unscale_(optimizer)
        stepped = precision.step(optimizer, skip=skip)
        optimizer.zero_grad()
        return stepped

    start = model.weight.detach().clone()
    assert (
        step() and len(seen) == 1 and torch.equal(seen[0], model.weight) and not torch.equal(seen[0], start)
    )
    assert not step(overflow=True) and len(seen) == 1  # GradScaler skipped the step: no precompute
    assert not step(skip=True) and len(seen) == 1  # the guard skipped it
    assert step() and len(seen) == 2 and torch.equal(seen[1], model.weight)
