"""Evaluation builds no gradients: the chunked loss follows grad mode (not requires_grad), so an eval
with it holds no vocab x hidden gradient buffer and peaks no higher than an eval with the full loss."""

import pytest
import torch
from accelerate import Accelerator
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import AutoConfig, AutoModelForCausalLM

from lmpretrain.model.loss import chunked_loss_sums
from lmpretrain.model.objective import LMObjective, install_loss_forward
from lmpretrain.model.precision import MixedPrecision
from lmpretrain.observe.evaluation import Evaluator

VOCAB, WIDTH = 2048, 256


pytestmark = pytest.mark.usefixtures("one_thread")


def wide_model():
    """Hidden states wide enough that the head's fp32 gradient (2 MiB) outweighs the eval's logits."""
    config = AutoConfig.for_model(
        "llama",
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    install_loss_forward(model)
    return model


def eval_peak_bytes(model, objective: LMObjective, blocks) -> tuple[float, int]:
    evaluator = Evaluator(
        blocks, objective, MixedPrecision("no", torch.device("cpu")), len(blocks), Accelerator(cpu=True)
    )  # one batch: MemTracker follows one iteration
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss = evaluator(model)["eval/loss"]
    return loss, tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_chunked_loss_builds_gradients_only_in_grad_mode():
    hidden = torch.randn(40, 16, requires_grad=True)
    weight = torch.randn(64, 16, requires_grad=True)
    targets = torch.randint(0, 64, (40,))
    built = []  # every tensor the loss allocates of the weight's or the hidden states' shape
    with torch.no_grad(), _Allocations(built):
        sums = chunked_loss_sums(hidden, weight, None, targets, chunk_tokens=16)
    assert not sums.objective.requires_grad and not built
    with _Allocations(built):
        sums = chunked_loss_sums(hidden, weight, None, targets, chunk_tokens=16)
    assert {tuple(s) for s in built} == {(40, 16), (64, 16)}  # grad mode: both gradients, once each
    sums.objective.backward()
    assert hidden.grad is not None and weight.grad is not None


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shapes of the 2-d tensors created by empty/zeros (the loss's gradient buffers)."""

    def __init__(self, shapes: list):
        super().__init__()
        self.shapes = shapes
        shapes.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.empty.memory_format, torch.ops.aten.zeros.default) and out.dim() == 2:
            self.shapes.append(out.shape)
        return out


def test_eval_with_the_chunked_loss_holds_no_gradient_buffer():
    model = wide_model()
    blocks = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))
    full_loss, full_peak = eval_peak_bytes(model, LMObjective(), blocks)
    chunked_loss, chunked_peak = eval_peak_bytes(
        model, LMObjective(loss_impl="chunked", chunk_tokens=16), blocks
    )
    head_grad = (
        VOCAB * WIDTH * 4
    )  # what the chunked loss allocated per eval batch before it followed grad mode
    print(
        f"eval peak tensor memory: full {full_peak / 2**20:.2f} MiB, chunked {chunked_peak / 2**20:.2f} MiB"
    )
    assert chunked_loss == pytest.approx(full_loss, rel=1e-5)
    assert chunked_peak <= full_peak < head_grad + chunked_peak
    assert all(p.grad is None for p in model.parameters()) and model.training
