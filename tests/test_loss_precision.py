"""Loss normalisation over micro-batches, clipping, and fp16 loss scaling on a real transformers model."""

import conftest
import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator

from lmpretrain.model.loss import IGNORE_INDEX, causal_lm_loss_sum, count_targets, make_labels
from lmpretrain.model.precision import MixedPrecision

VOCAB = 96


def tiny_llama(seed=0):
    return conftest.tiny_llama(seed, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False)


def batch_with_uneven_ignores(seed=1, rows=8, seq=16):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, seq), generator=g)
    labels = ids.clone()
    labels[0, 2:] = IGNORE_INDEX  # micro-batch 0 keeps very few targets
    labels[1, 5:9] = IGNORE_INDEX
    labels[5, :] = IGNORE_INDEX  # one fully ignored row in micro-batch 2
    return ids, labels


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def rel_err(a, b):
    """Relative error of the whole vector (per-element ratios of ~1e-9 entries are fp32 noise)."""
    return ((a - b).norm() / b.norm()).item()


def test_token_sum_matches_torch_mean_and_label_smoothing():
    ids, labels = batch_with_uneven_ignores(seq=7)
    logits = torch.randn(len(ids), 7, VOCAB)
    for smoothing in (0.0, 0.1):
        ref = F.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB),
            labels[:, 1:].reshape(-1),
            ignore_index=IGNORE_INDEX,
            label_smoothing=smoothing,
        )
        ours = causal_lm_loss_sum(logits, labels, smoothing) / count_targets(labels)
        assert ours.item() == pytest.approx(ref.item(), rel=1e-6)


def test_accumulated_micro_batches_equal_one_big_batch_with_uneven_ignores():
    ids, labels = batch_with_uneven_ignores()
    big = tiny_llama()
    ref_loss = causal_lm_loss_sum(big(input_ids=ids).logits, labels) / count_targets(labels)
    ref_loss.backward()

    acc = tiny_llama()
    total = count_targets(labels)
    for x, y in zip(
        ids.split(2), labels.split(2), strict=True
    ):  # 4 micro-batches with different target counts
        (causal_lm_loss_sum(acc(input_ids=x).logits, y) / total).backward()
    assert rel_err(grads(acc), grads(big)) < 1e-6

    # The pitfall the normalisation avoids: averaging per-micro-batch means weights them equally.
    naive = tiny_llama()
    for x, y in zip(ids.split(2), labels.split(2), strict=True):
        (causal_lm_loss_sum(naive(input_ids=x).logits, y) / count_targets(y) / 4).backward()
    assert rel_err(grads(naive), grads(big)) > 1e-2


def test_mask_cross_doc_targets_ignores_first_token_of_each_document():
    eos = 1
    ids = torch.tensor([[5, 6, eos, 7, 8, eos, eos, 9]])
    assert make_labels(ids, eos).tolist() == [[5, 6, eos, -100, 8, eos, -100, -100]]
    assert make_labels(ids).tolist() == ids.tolist()
    assert count_targets(make_labels(ids, eos)) == 4


def test_accelerate_clip_matches_torch_clip_grad_norm():
    ids, labels = batch_with_uneven_ignores()
    models = [tiny_llama(), tiny_llama()]
    for m in models:
        (causal_lm_loss_sum(m(input_ids=ids).logits, labels) * 10).backward()
    accelerator = Accelerator(cpu=True)
    ours = accelerator.clip_grad_norm_(models[0].parameters(), 0.5)
    ref = torch.nn.utils.clip_grad_norm_(models[1].parameters(), 0.5)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-6) and ref.item() > 0.5  # it really clipped
    torch.testing.assert_close(grads(models[0]), grads(models[1]))
    assert grads(models[0]).norm().item() == pytest.approx(0.5, rel=1e-4)


def test_fp16_autocast_really_runs_fp16_on_cpu():
    mp = MixedPrecision("fp16", torch.device("cpu"))
    model = tiny_llama()
    with mp.autocast():
        logits = model(input_ids=torch.randint(0, VOCAB, (2, 8))).logits
    assert logits.dtype == torch.float16
    assert mp.loss_scale == 2.0**16


def test_fp16_overflow_skips_the_step_halves_the_scale_and_keeps_params():
    mp = MixedPrecision("fp16", torch.device("cpu"))
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, labels = batch_with_uneven_ignores()
    before = [p.detach().clone() for p in model.parameters()]
    with mp.autocast():
        logits = model(input_ids=ids).logits
    mp.scale(causal_lm_loss_sum(logits, labels) / count_targets(labels)).backward()
    next(model.parameters()).grad[0, 0] = float("inf")  # an overflowed gradient
    mp.unscale_(opt)
    assert mp.step(opt) is False
    assert mp.loss_scale == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert opt.state == {} or all(s.get("step", 0) == 0 for s in opt.state.values())

    opt.zero_grad()
    with mp.autocast():
        logits = model(input_ids=ids).logits
    mp.scale(causal_lm_loss_sum(logits, labels) / count_targets(labels)).backward()
    mp.unscale_(opt)
    assert mp.step(opt) is True  # a clean step goes through and keeps the scale
    assert mp.loss_scale == 2.0**15
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    state = mp.state_dict()
    fresh = MixedPrecision("fp16", torch.device("cpu"))
    fresh.load_state_dict(state)
    assert fresh.loss_scale == 2.0**15 and fresh.state_dict() == state


def test_bf16_and_fp32_have_no_scaler():
    for name in ("no", "bf16"):
        mp = MixedPrecision(name, torch.device("cpu"))
        assert mp.scaler is None and mp.state_dict() is None
        loss = torch.tensor(3.0)
        assert mp.scale(loss) is loss
