"""The objective's public API for forks (docs/forking.md section 4): the model runs once per micro-batch and
its output (final hidden states, the base model's output object) reaches every term; an auxiliary head is
scored by `token_loss` with the run's loss_impl, label smoothing and z-loss; per-token losses; FLOPs count
the fork's auxiliary modules; docs/forking.md shows the tested multi-token-prediction fork whole."""

import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import one_layer_llama_config
from transformers import AutoConfig, AutoModelForCausalLM

from lmpretrain.config import load_config
from lmpretrain.model import IGNORE_INDEX, LMObjective, Term, make_labels, weighted_sum
from lmpretrain.observe.flops import MFUMeter

FORKS = Path(__file__).parent / "forks"
sys.path.insert(0, str(FORKS))
from pretrain_mtp import MTPObjective, skip_one  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 96
ROOT = Path(__file__).resolve().parents[1]


def tiny_model():
    torch.manual_seed(0)
    config = one_layer_llama_config(VOCAB, max_position_embeddings=32, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="eager")


def batch():
    ids = torch.randint(2, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
    ids[1, 5] = 1  # an EOS: its next target is ignored
    return ids, make_labels(ids, ignore_after_token=1)


def by_hand(logits, targets, smoothing, z_loss):
    """Sum over targets of (smoothed) cross-entropy + z_loss * logsumexp^2, written out."""
    keep = targets != IGNORE_INDEX
    logp = torch.log_softmax(logits[keep], dim=-1)
    picked = -logp.gather(1, targets[keep][:, None]).squeeze(1)
    ce = (1 - smoothing) * picked - smoothing * logp.mean(dim=-1)
    return (ce + z_loss * torch.logsumexp(logits[keep], dim=-1).square()).sum()


@pytest.mark.parametrize("loss_impl", ["full", "chunked"])
def test_an_auxiliary_head_reads_the_one_forward_and_keeps_smoothing_and_z_loss(loss_impl):
    model = tiny_model()
    objective = MTPObjective(
        loss_impl=loss_impl, chunk_tokens=7, label_smoothing=0.1, z_loss=1e-3, mtp_weight=0.3
    )
    objective.install(model)
    calls = []
    model.model.register_forward_hook(lambda *_: calls.append(1))
    ids, labels = batch()
    terms = objective(model, ids, labels)
    assert len(calls) == 1  # the base model ran once for both terms
    assert set(terms) == {"loss", "z_loss", "mtp"} and terms["mtp"].weight == 0.3
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        targets = torch.full_like(labels, IGNORE_INDEX)
        targets[:, :-1] = labels[:, 1:]
        ahead = skip_one(targets)
        mtp = by_hand(model.lm_head(model.mtp_proj(hidden)), ahead, 0.1, 1e-3)
        loss = by_hand(model.lm_head(hidden), targets, 0.1, 0.0)  # `loss` is the (smoothed) ce, z apart
    assert terms["mtp"].sum.item() == pytest.approx(mtp.item(), rel=1e-10)
    assert terms["mtp"].count.item() == (ahead != IGNORE_INDEX).sum().item() == 29
    assert terms["loss"].sum.item() == pytest.approx(loss.item(), rel=1e-10)


def test_the_auxiliary_terms_gradients_are_the_same_under_full_and_chunked_losses():
    ids, labels = batch()
    grads = {}
    for loss_impl in ("full", "chunked"):
        model = tiny_model()
        objective = MTPObjective(loss_impl=loss_impl, chunk_tokens=5, z_loss=1e-3, mtp_weight=0.5)
        objective.install(model)
        weighted_sum(objective(model, ids, labels)).backward()
        grads[loss_impl] = torch.cat([p.grad.flatten() for p in model.parameters()])
    difference = (grads["chunked"] - grads["full"]).norm() / grads["full"].norm()
    assert difference.item() < 1e-10 and grads["full"].abs().sum() > 0


@pytest.mark.parametrize("loss_impl", ["full", "chunked"])
def test_per_token_losses_sum_to_the_loss_and_agree_between_implementations(loss_impl):
    model = tiny_model()
    objective = LMObjective(loss_impl=loss_impl, chunk_tokens=7, per_token=True)
    objective.install(model)
    ids, labels = batch()
    with torch.no_grad():
        loss = objective(model, ids, labels)["loss"]
        logits = model.lm_head(model.model(input_ids=ids).last_hidden_state)
    assert loss.per_token.shape == ids.shape
    assert loss.per_token.sum().item() == pytest.approx(loss.sum.item(), rel=1e-12)
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="none")
    expected = expected.reshape(3, 11)
    assert torch.allclose(loss.per_token[:, :-1], expected, rtol=1e-10, atol=1e-12)
    assert loss.per_token[1, 5] == 0 and (loss.per_token[:, -1] == 0).all()  # no target: 0
    assert LMObjective(loss_impl=loss_impl)(model, ids, labels)["loss"].per_token is None  # not asked


def test_the_base_models_output_object_reaches_a_forks_terms():
    """A mixture of experts' router logits, asked for through model_inputs, read in terms(): what a router
    load-balancing term needs, with the model run once."""

    @dataclass(frozen=True)
    class RouterProbe(LMObjective):
        def model_inputs(self, input_ids, labels):
            return {**super().model_inputs(input_ids, labels), "output_router_logits": True}

        def terms(self, model, out, targets):
            terms = super().terms(model, out, targets)
            probs = torch.softmax(torch.stack(out.output.router_logits).float(), dim=-1)
            terms["router_entropy"] = Term(
                -(probs * probs.log()).sum(), torch.tensor(probs[..., 0].numel()), 0.0
            )
            return terms

    config = AutoConfig.for_model(
        "mixtral", vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")  # grouped mm: fp32
    ids, labels = batch()
    for loss_impl in ("full", "chunked"):
        objective = RouterProbe(loss_impl=loss_impl)
        objective.install(model)
        terms = objective(model, ids, labels)
        assert terms["router_entropy"].count.item() == 2 * 3 * 12  # layers x tokens
        assert 0 < terms["router_entropy"].sum.item() / (2 * 36) < torch.log(torch.tensor(4.0)).item()


def test_flops_count_the_forks_auxiliary_modules_and_its_second_pass_through_the_head():
    model = tiny_model()
    plain = LMObjective()
    assert plain.extra_matmul_params(model) == 0
    mtp = MTPObjective(mtp_weight=0.1)
    mtp.install(model)
    assert mtp.extra_matmul_params(model) == 16 * 16 + VOCAB * 16  # mtp_proj, then the tied head again
    cfg = load_config([str(ROOT / "configs" / "smoke.yaml"), "--data.seq_len=12"])
    base = MFUMeter.for_run(model.config, cfg, torch.device("cpu"), torch.float32)
    meter = MFUMeter.for_run(
        model.config, cfg, torch.device("cpu"), torch.float32, mtp.extra_matmul_params(model)
    )
    assert meter.flops_per_token == base.flops_per_token + 6 * (16 * 16 + VOCAB * 16)
    assert "+ 6 x 1,792 weights of the objective's auxiliary modules" in meter.describe()


def test_docs_forking_shows_the_tested_multi_token_prediction_fork_whole():
    doc = (ROOT / "docs" / "forking.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    fork = (FORKS / "pretrain_mtp.py").read_text()
    assert fork in blocks, "docs/forking.md must show tests/forks/pretrain_mtp.py as it is"


def test_held_out_scoring_asks_for_per_token_losses_and_scores_liger_runs_with_the_chunked_loss():
    objective = LMObjective(loss_impl="liger", label_smoothing=0.1, z_loss=1e-4)
    held = objective.held_out()
    assert held == replace(objective, loss_impl="chunked", label_smoothing=0.0, z_loss=0.0, per_token=True)
