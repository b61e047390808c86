"""WeightAverage on its own: the update rule, the swap that restores the live weights exactly, and its
round trip through every checkpoint format, sync and async (in one process; the recipe's multi-process
runs are in test_ema.py)."""

import conftest
import pytest
import torch

from lmpretrain.checkpoint.checkpointer import Checkpointer
from lmpretrain.update import WeightAverage


def tiny_llama(seed: int):
    return conftest.tiny_llama(seed, num_hidden_layers=1)


def step(model, optimizer) -> None:
    ids = torch.randint(0, 97, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_update_rule_start_and_an_exact_swap():
    model = tiny_llama(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = WeightAverage(model, decay=0.75, start=1)
    assert len(ema.names) == len(list(model.parameters()))  # tied embeddings once
    expected = None
    for s in range(1, 5):
        step(model, optimizer)
        ema.update(s)
        w = {n: p.detach().double() for n, p in model.named_parameters()}
        expected = w if s <= 1 else {n: 0.75 * expected[n] + 0.25 * w[n] for n in w}
    for n, a in ema.state_dict().items():
        assert a.dtype == torch.float32 and torch.allclose(a.double(), expected[n], rtol=0, atol=1e-6), n
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ema.swapped(model):
        for n, p in model.named_parameters():
            assert torch.equal(p, ema.state_dict()[n]), n
    for n, p in model.named_parameters():
        assert torch.equal(p, live[n]), n  # put back bit for bit
    assert "decay 0.75, from step 1): one float32 copy of the parameters" in ema.describe()


@pytest.mark.parametrize("fmt", ["full", "sharded"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_every_format_round_trips_the_average_bit_exactly(tmp_path, fmt, async_save):
    model = tiny_llama(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = WeightAverage(model, decay=0.9)
    for s in range(1, 4):
        step(model, optimizer)
        ema.update(s)
    ck = Checkpointer(tmp_path, format=fmt, async_save=async_save)
    saved = {n: a.clone() for n, a in ema.state_dict().items()}
    path = ck.save(3, model=model, optimizer=optimizer, states={}, averages={"ema": ema})
    step(model, optimizer)  # training (and the average) go on while an async write runs
    ema.update(4)
    assert ck.wait() in (path, None)
    fresh = tiny_llama(1)
    restored = WeightAverage(fresh, decay=0.9)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ck.load(path, model=fresh, optimizer=fresh_opt, states={}, averages={"ema": restored})
    for n, a in restored.state_dict().items():
        assert torch.equal(a, saved[n]), n
    # A checkpoint without an average: the average restarts from the loaded weights.
    plain = Checkpointer(tmp_path / "plain", format=fmt)
    plain.save(3, model=model, optimizer=optimizer, states={})
    target = tiny_llama(2)
    other = WeightAverage(target, decay=0.9)
    plain.load(
        tmp_path / "plain/checkpoints/step-00000003",
        model=target,
        optimizer=torch.optim.AdamW(target.parameters()),
        states={},
        averages={"ema": other},
    )
    for n, p in model.named_parameters():
        assert torch.equal(other.state_dict()[n], p.detach()), n
    ck.close()
