"""LMObjective.logit_terms: a fork's term on the logits the loss already computes, equal under the full and
the chunked loss (values and gradients), equal to its hand computation, and logged at evaluation."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from conftest import one_layer_llama_config
from transformers import AutoModelForCausalLM

from lmpretrain.errors import ConfigError
from lmpretrain.model import make_labels, weighted_sum
from lmpretrain.model.precision import MixedPrecision
from lmpretrain.observe.evaluation import Evaluator

sys.path.insert(0, str(Path(__file__).parent / "forks"))
from pretrain_entropy import EntropyObjective  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 96


def tiny_model():
    torch.manual_seed(0)
    config = one_layer_llama_config(VOCAB, max_position_embeddings=32, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="eager")


def batch():
    ids = torch.randint(2, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
    ids[1, 5] = 1  # an EOS: with mask_cross_doc_targets the next target is ignored
    return ids, make_labels(ids, ignore_after_token=1)


def step(objective, model, ids, labels):
    model.zero_grad(set_to_none=True)
    terms = objective(model, ids, labels)
    weighted_sum(terms).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {name: (t.sum.item(), t.count.item()) for name, t in terms.items()}, grads


def test_an_entropy_term_from_the_logits_equals_its_hand_computation_under_full_and_chunked_losses():
    model = tiny_model()
    full = EntropyObjective(loss_impl="full", entropy_weight=0.3, z_loss=1e-3)
    full.install(model)
    ids, labels = batch()
    values, grads = step(full, model, ids, labels)
    assert set(values) == {"loss", "z_loss", "entropy"}

    with torch.no_grad():  # by hand, from the model's own logits
        logits = type(model).forward(model, input_ids=ids).logits.double()
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        targets = labels[:, 1:]
        keep = targets != -100
        by_hand = (-(logp.exp() * logp).sum(-1) * keep).sum().item()
    assert values["entropy"] == (pytest.approx(by_hand, rel=1e-12), keep.sum().item())

    for chunk in (5, 7, 64):  # chunks that cut rows unevenly, and one chunk for everything
        chunked = replace(full, loss_impl="chunked", chunk_tokens=chunk)
        got, got_grads = step(chunked, model, ids, labels)
        for name in values:
            assert got[name][0] == pytest.approx(values[name][0], rel=1e-10), (chunk, name)
        for name, g in grads.items():
            assert (got_grads[name] - g).norm() <= 1e-10 * g.norm(), (chunk, name)

    # The term's weight reaches the gradient: without it the gradients differ by weight x d(entropy).
    _, plain = step(replace(full, entropy_weight=0.0), model, ids, labels)
    assert any((plain[n] - g).norm() > 1e-6 * g.norm() for n, g in grads.items())


def test_the_term_is_logged_at_evaluation_and_refused_with_liger():
    model = tiny_model()
    objective = EntropyObjective(loss_impl="chunked", chunk_tokens=8, entropy_weight=0.3)
    objective.install(model)
    blocks = torch.randint(2, VOCAB, (4, 12), generator=torch.Generator().manual_seed(2))
    evaluator = Evaluator(
        blocks, objective, MixedPrecision("no", torch.device("cpu")), 2, Accelerator(cpu=True)
    )
    metrics = evaluator(model)
    with torch.no_grad():
        logp = torch.log_softmax(type(model).forward(model, input_ids=blocks).logits[:, :-1].double(), dim=-1)
        mean_entropy = (-(logp.exp() * logp).sum(-1)).mean().item()
    assert metrics["eval/entropy"] == pytest.approx(mean_entropy, rel=1e-10)
    with pytest.raises(ConfigError, match="train.loss_impl=liger never forms"):
        replace(objective, loss_impl="liger").install(tiny_model())
