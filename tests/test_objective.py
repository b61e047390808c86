"""The training objective on real transformers models: chunked loss = full loss (values and gradients),
z-loss, document masking = documents run alone, the start-up checks that refuse what a model cannot do,
and the memory the chunked loss and activation checkpointing save."""

from importlib.util import find_spec

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

from lmpretrain.config import Config
from lmpretrain.errors import ConfigError
from lmpretrain.model.build import build_model_config
from lmpretrain.model.loss import IGNORE_INDEX, chunked_loss_sums, logits_loss_sums
from lmpretrain.model.objective import (
    LMObjective,
    check_objective,
    document_positions,
    install_loss_forward,
    weighted_sum,
)
from lmpretrain.model.speed import enable_activation_checkpointing, kernel_problems, prepare_model

EOS = 3
VOCAB = 64


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(kind="llama", attn="sdpa", dtype=torch.float32, seed=0, **overrides):
    """A real transformers model of `kind` with the objective's forward installed."""
    shapes = {
        "llama": dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        ),
        "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64),
        "opt": dict(
            hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=64
        ),
        "gemma2": dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        ),
    }[kind]
    config = AutoConfig.for_model(
        kind, use_cache=False, attn_implementation=attn, **{"vocab_size": VOCAB, **shapes, **overrides}
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    install_loss_forward(model)
    return model


def three_documents(seed=0, lengths=(5, 9, 6)):
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(EOS + 1, VOCAB, (n,), generator=gen) for n in lengths]
    for d in docs:
        d[-1] = EOS
    return docs


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


# ---- chunked loss and z-loss ------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_chunked_loss_equals_full_loss_values_and_gradients(dtype, tolerance):
    """Label smoothing, z-loss, a bias, ignored targets and a chunk size that does not divide the rows."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 37, 16, dtype=dtype, generator=gen)
    weight = torch.randn(VOCAB, 16, dtype=dtype, generator=gen)
    bias = torch.randn(VOCAB, dtype=dtype, generator=gen)
    targets = torch.randint(0, VOCAB, (2, 37), generator=gen)
    targets[0, :9] = IGNORE_INDEX
    targets[:, -1] = IGNORE_INDEX
    for smoothing, z_loss in ((0.0, 0.0), (0.1, 1e-2)):
        inputs = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        full = logits_loss_sums(F.linear(*inputs), targets, smoothing, z_loss)
        full.objective.backward()
        chunked_inputs = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        chunked = chunked_loss_sums(
            *chunked_inputs, targets, chunk_tokens=7, label_smoothing=smoothing, z_loss=z_loss
        )
        (chunked.objective * 3).backward()  # backward scales the gradients computed in the forward
        for name in ("objective", "ce", "z"):
            assert getattr(chunked, name).item() == pytest.approx(getattr(full, name).item(), rel=tolerance)
        for ours, ref in zip(chunked_inputs, inputs, strict=True):
            assert rel(ours.grad / 3, ref.grad) < tolerance


def test_z_loss_is_the_sum_of_squared_logsumexp_over_targets():
    logits = torch.randn(3, 5, VOCAB, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (3, 5))
    targets[1, 2:] = IGNORE_INDEX
    sums = logits_loss_sums(logits, targets, z_loss=1e-3)
    kept = logits[targets != IGNORE_INDEX]
    expected_z = (kept.exp().sum(-1).log() ** 2).sum()
    assert sums.z.item() == pytest.approx(expected_z.item(), rel=1e-12)
    assert sums.objective.item() == pytest.approx((sums.ce + 1e-3 * expected_z).item(), rel=1e-12)


def test_chunked_loss_trains_a_tied_embedding_model_like_the_full_loss():
    """Through the model's forward: the output embedding is the input embedding (tied), float64."""
    ids = torch.randint(EOS + 1, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :4] = IGNORE_INDEX
    runs = {}
    for impl in ("full", "chunked"):
        model = tiny(dtype=torch.float64)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        objective = LMObjective(loss_impl=impl, chunk_tokens=16, label_smoothing=0.1, z_loss=1e-3)
        sums = objective(model, ids, labels)
        weighted_sum(sums).backward()
        runs[impl] = (sums, grads(model))
    assert runs["chunked"][0]["loss"].sum.item() == pytest.approx(
        runs["full"][0]["loss"].sum.item(), rel=1e-12
    )
    assert rel(runs["chunked"][1], runs["full"][1]) < 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_loss_under_autocast_stays_close_to_full(dtype):
    ids = torch.randint(EOS + 1, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    results = {}
    for impl in ("full", "chunked"):
        model = tiny()
        with torch.autocast("cpu", dtype=dtype):
            sums = LMObjective(loss_impl=impl, chunk_tokens=10)(model, ids, ids)
        weighted_sum(sums).backward()
        results[impl] = (sums["loss"].sum, grads(model))
        assert (
            sums["loss"].sum.dtype == torch.float32
        )  # the loss is summed in fp32 whatever the compute dtype
    assert results["chunked"][0].item() == pytest.approx(results["full"][0].item(), rel=1e-3)
    assert rel(results["chunked"][1], results["full"][1]) < 3e-2  # 16-bit logits and matmuls


# ---- document masking -------------------------------------------------------------------------


def test_document_positions_restart_after_each_eos():
    ids = torch.tensor([[7, 8, EOS, 9, EOS, EOS, 5], [EOS, 4, 4, 4, EOS, 6, 6]])
    assert document_positions(ids, EOS).tolist() == [[0, 1, 2, 0, 1, 0, 0], [0, 0, 1, 2, 3, 0, 1]]


@pytest.mark.parametrize(
    "kind,attn,single_row",
    [("llama", "sdpa", False), ("llama", "eager", False), ("llama", "sdpa", True), ("gpt2", "sdpa", False)],
)
def test_packed_documents_score_like_the_documents_run_alone(kind, attn, single_row):
    """Per-token losses of a block packing three documents equal those of each document alone (with
    single_row: in a micro-batch of two blocks laid out as one row, as flash-attention varlen reads it)."""
    model = tiny(kind, attn).eval()
    docs = three_documents()
    block = torch.cat(docs)[None]
    objective = LMObjective(document_masking=True, eos_token_id=EOS, single_row=single_row)
    batch = torch.cat([block, block.flip(1)]) if single_row else block
    with torch.no_grad():
        alone = torch.cat(
            [F.cross_entropy(model(input_ids=d[None]).logits[0, :-1], d[1:], reduction="none") for d in docs]
        )
        inputs = objective.model_inputs(batch, batch)  # the layout and positions training uses
        logits = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]).logits[0]
        per_token = F.cross_entropy(logits[:-1], inputs["input_ids"][0, 1:], reduction="none")
        eos_at = torch.cumsum(torch.tensor([len(d) for d in docs]), 0)[:-1] - 1
        inside = torch.ones(block.size(1) - 1, dtype=torch.bool)
        inside[eos_at] = False  # an EOS's target is the next document's first token
        assert (per_token[: block.size(1) - 1][inside] - alone).abs().max().item() <= 1e-5
        # The objective's own sums agree with those per-token losses (targets crossing documents dropped).
        labels = batch.clone()
        labels[:, eos_at + 1] = IGNORE_INDEX
        labels[1:] = IGNORE_INDEX
        assert objective(model, batch, labels)["loss"].sum.item() == pytest.approx(
            alone.sum().item(), rel=1e-5
        )
        unmasked = F.cross_entropy(model(input_ids=block).logits[0, :-1], block[0, 1:], reduction="none")
    assert (unmasked[inside] - alone).abs().max().item() > 1e-2  # without masking the documents would mix


def test_check_refuses_a_model_that_lets_documents_see_each_other():
    model = tiny("opt")
    objective = LMObjective(document_masking=True, eos_token_id=EOS)
    with pytest.raises(
        ConfigError, match="a opt model lets attention or positions cross document boundaries"
    ):
        check_objective(model, objective)
    lines = check_objective(tiny("gpt2"), objective)
    assert lines == [lines[0]] and "packed documents = documents alone for gpt2 with sdpa" in lines[0]


def test_check_refuses_chunked_loss_for_soft_capped_logits_and_accepts_full():
    model = tiny("gemma2", "eager", final_logit_softcapping=30.0)
    with pytest.raises(ConfigError, match="gemma2 model post-processes its logits"):
        check_objective(model, LMObjective(loss_impl="chunked"))
    assert check_objective(model, LMObjective(loss_impl="full")) == []
    assert (
        "logits = output embedding(final hidden states) for llama"
        in check_objective(tiny(), LMObjective(loss_impl="chunked"))[0]
    )


def test_checks_leave_training_rng_and_mode_untouched():
    model = tiny().train()
    before = torch.get_rng_state()
    check_objective(model, LMObjective(loss_impl="chunked", document_masking=True, eos_token_id=EOS))
    assert torch.equal(torch.get_rng_state(), before) and model.training


def test_kernels_and_losses_that_cannot_run_here_are_config_problems(small_tokenizer):
    def problems(**sections):
        cfg = Config()
        for section, fields in sections.items():
            for name, value in fields.items():
                setattr(getattr(cfg, section), name, value)
        return "\n".join(kernel_problems(cfg, build_model_config(cfg.model)))

    assert problems() == ""
    text = problems(model={"attn_implementation": "flash_attention_2"})
    assert "flash_attention_2 needs a CUDA GPU and `pip install flash-attn` (no CUDA device here)" in text
    assert "computes in bf16/fp16 only: set train.precision=bf16" in text
    text = problems(train={"loss_impl": "liger"})
    # The same probe the check asks: requirements.txt installs liger-kernel, a bare environment may not.
    package = "the liger-kernel package (pip install -e .[gpu]) and " if not find_spec("liger_kernel") else ""
    assert f"train.loss_impl=liger needs {package}a CUDA GPU; use train.loss_impl=chunked" in text
    text = problems(model={"type": "gpt2", "attn_implementation": "flex_attention"})
    assert "transformers' GPT2LMHeadModel does not implement it; use sdpa" in text
    text = problems(model={"type": "bloom"}, data={"document_masking": True})
    assert "a bloom model takes no position_ids" in text


# ---- activation checkpointing and memory ------------------------------------------------------


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_dropout_masks_and_the_rng_stream(mode):
    """With dropout, gradients are bit-identical with and without checkpointing, and the torch RNG ends in
    the same state (the recompute replays the saved RNG state instead of drawing new numbers)."""
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    results = []
    for checkpointing in ("none", mode):
        model = tiny("gpt2", resid_pdrop=0.2, embd_pdrop=0.1, attn_pdrop=0.1).train()
        line = enable_activation_checkpointing(model, checkpointing)
        assert line.startswith(f"activation checkpointing: {checkpointing}")
        assert (
            checkpointing == "none" or f"{mode}, 2 blocks" in line and "non-reentrant, RNG preserved" in line
        )
        torch.manual_seed(7)
        weighted_sum(LMObjective()(model, ids, ids)).backward()
        results.append((grads(model), torch.get_rng_state()))
    (g0, rng0), (g1, rng1) = results
    assert torch.equal(g0, g1) and torch.equal(rng0, rng1)


@pytest.mark.parametrize("kind,attn", [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa")])
def test_selective_checkpointing_equals_eager_in_float64(kind, attn):
    """Loss and every gradient equal to the model without checkpointing (float64, CPU): the kept matmul and
    attention outputs are the forward's own, the recomputed ops run on the same inputs again."""
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    results = []
    for mode in ("none", "selective"):
        model = tiny(kind, attn=attn, dtype=torch.float64).train()
        enable_activation_checkpointing(model, mode)
        loss = weighted_sum(LMObjective()(model, ids, ids))
        loss.backward()
        results.append((loss.detach(), grads(model)))
    (loss0, g0), (loss1, g1) = results
    assert torch.equal(loss0, loss1) and torch.equal(g0, g1)


class BackwardMatmuls(TorchDispatchMode):
    """Counts the matmul kernels (mm, addmm, bmm) that run while it is active, by op name."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm"):
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def backward_matmuls(kind: str, mode: str, attn="sdpa") -> dict[str, int]:
    model = tiny(kind, attn=attn, dtype=torch.float64).train()
    enable_activation_checkpointing(model, mode)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    loss = weighted_sum(LMObjective()(model, ids, ids))
    with BackwardMatmuls() as counter:
        loss.backward()
    return counter.counts


@pytest.mark.parametrize(
    "kind,attn,forward_per_block",
    [
        # q, k, v, o, gate, up (no bias: mm); not down: torch's recompute stops at the last tensor backward
        # needs, and down's output only feeds the residual add
        ("llama", "sdpa", {"mm": 6}),
        ("llama", "eager", {"mm": 6, "bmm": 2}),  # + the scores and the weighted values
        # Conv1D c_attn, attn c_proj, c_fc, mlp c_proj (bias: addmm; the last feeds a dropout, whose mask is
        # needed) + sdpa's math path, which CPU takes with attention dropout (GPT-2's default 0.1)
        ("gpt2", "sdpa", {"addmm": 4, "bmm": 2}),
    ],
)
def test_selective_checkpointing_keeps_the_matmul_outputs(kind, attn, forward_per_block):
    """In backward, full checkpointing runs each block's forward matmuls again (2 blocks here); selective
    runs none of them again: its backward has exactly the matmuls of the backward without checkpointing
    (the gradients': 2 per linear layer)."""
    none = backward_matmuls(kind, "none", attn)
    full = backward_matmuls(kind, "full", attn)
    selective = backward_matmuls(kind, "selective", attn)
    recomputed = {op: full.get(op, 0) - none.get(op, 0) for op in set(full) | set(none)}
    assert {op: n for op, n in recomputed.items() if n} == {op: 2 * n for op, n in forward_per_block.items()}
    assert selective == none
    # the gradients' own: input and weight of each linear layer, the blocks' (7 in Llama, 4 in GPT-2) and the head
    assert none["mm"] == 2 * (2 * {"llama": 7, "gpt2": 4}[kind] + 1)


def test_accelerates_own_fsdp_checkpointing_is_refused():
    """Its wrapper does not preserve the RNG state. (accelerate builds no FSDP plugin on a CPU-only
    launch, so the plugin is handed over the way `accelerator.state` holds it.)"""
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=True)
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))
    with pytest.raises(
        ConfigError, match="fsdp_activation_checkpointing: true, whose checkpointing does not"
    ):
        prepare_model(tiny(), Config().train, accelerator)


def peak_bytes(model, objective, ids) -> int:
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        weighted_sum(objective(model, ids, ids)).backward()
    model.zero_grad(set_to_none=True)
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_chunked_loss_and_activation_checkpointing_lower_peak_memory():
    """Shapes where they matter: a vocabulary 64x the width (logits dominate the loss), and 8 layers of
    256-token rows (block activations dominate once the loss is chunked). Selective checkpointing lies
    between none and full."""
    ids = torch.randint(0, 2048, (2, 256), generator=torch.Generator().manual_seed(4))
    model = tiny(vocab_size=2048, num_hidden_layers=8, max_position_embeddings=256)
    chunked_loss = LMObjective(loss_impl="chunked", chunk_tokens=64)
    full = peak_bytes(model, LMObjective(), ids)
    chunked = peak_bytes(model, chunked_loss, ids)
    enable_activation_checkpointing(model, "selective")
    selective = peak_bytes(model, chunked_loss, ids)
    enable_activation_checkpointing(model, "full")
    checkpointed = peak_bytes(model, chunked_loss, ids)
    logits_fp32 = ids.numel() * 2048 * 4
    print(
        f"peak tensor memory: full loss {full / 2**20:.1f} MiB, chunked {chunked / 2**20:.1f} MiB, "
        f"chunked + selective checkpointing {selective / 2**20:.1f} MiB, chunked + full checkpointing "
        f"{checkpointed / 2**20:.1f} MiB"
    )
    assert chunked < full - 2 * logits_fp32  # the fp32 logits and their gradient are never held
    assert checkpointed < chunked / 2
    assert checkpointed < selective < chunked  # it keeps the matmul and attention outputs, not the rest
