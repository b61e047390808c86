"""Expert parallelism (model.ep_size) through transformers' DistributedConfig: what is refused before any
work, (slow) real gloo ranks with the experts split over ep_size=2 ranks training like one process
(float64, two Muon steps; routing as it comes and routing that leaves the second rank of each ep group no
token; 2 ranks, and 4 as FSDP2 and HSDP), and (slow) the recipe: 2 ranks (FSDP2) and 4 (HSDP) with
ep_size=2 equal one process over 10 steps, resume bit-identically after kill -9 and export a model
from_pretrained loads."""

import pytest
import torch
from moe_ep_models import ROUTINGS, batch, build, cases, muon_cfg

import recipe_runner as rr
from lmpretrain.update.optim import build_optimizer


def one_process_reference() -> dict:
    """Each (routing, implementation)'s weights after the same two Muon steps in this process, and its
    gradients at the first step."""
    assert not torch.distributed.is_initialized(), "an earlier test left a process group initialised"
    out = {}
    for routing in ROUTINGS:
        for experts in ("batched_mm", "eager"):
            model = build(routing, experts)
            opt = build_optimizer(model, muon_cfg())
            grads = {}
            for step in range(2):
                ids = batch(step)
                model(input_ids=ids, labels=ids).loss.backward()
                if step == 0:
                    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                opt.step()
                opt.zero_grad(set_to_none=True)
            out[routing, experts] = {
                "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
                "grads": grads,
            }
    return out


def tokens_per_expert(routing: str) -> torch.Tensor:
    """(layers, experts): how many of the first batch's tokens each expert of each layer is given."""
    model = build(routing)
    out = model(input_ids=batch(0), output_router_logits=True)
    return torch.stack(
        [
            torch.bincount(logits.topk(2, dim=-1).indices.flatten(), minlength=4)
            for logits in out.router_logits
        ]
    )


@pytest.fixture(scope="module")
def reference():
    return one_process_reference()


def test_the_routings_are_uneven_and_skewed_leaves_experts_2_and_3_without_tokens(reference):
    natural, skewed = tokens_per_expert("natural"), tokens_per_expert("skewed")
    assert (natural.amax(dim=1) > natural.amin(dim=1)).all() and natural.sum() == 2 * 2 * 8 * 12, natural
    assert (skewed[:, 2:] == 0).all() and (skewed[:, :2] == 8 * 12).all(), skewed
    grads = reference["skewed", "batched_mm"]["grads"]
    for name in ("gate_up_proj", "down_proj"):  # no token: exactly zero gradients for experts 2 and 3
        g = grads[f"model.layers.0.mlp.experts.{name}"]
        assert g[2:].abs().max() == 0 and g[:2].abs().max() > 0, name


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_with_experts_split_over_2_train_like_one_process(world, reference, tmp_path):
    out = tmp_path / "runs.pt"
    rr.launch_ranks(rr.ROOT / "tests" / "moe_ep_worker.py", str(out), world=world, timeout=900)
    runs = torch.load(out, weights_only=False)
    assert set(runs) == set(cases(world))
    for (routing, experts, layout), run in runs.items():
        ref, ref_grads = reference[routing, experts]["weights"], reference[routing, experts]["grads"]
        # rank 0 holds 2 of the 4 experts at 2 ranks; at 4 the ep group's pair is FSDP-sharded once more,
        # except under HSDP, where the other replica group holds the same 2
        held = 2 if world == 2 or layout == "hsdp" else 1
        assert set(run["local_experts"].values()) == {held}, run["local_experts"]
        for name, w in run["weights"].items():
            diff = ((w - ref[name]).norm() / ref[name].norm()).item()
            assert diff < 1e-12, (routing, experts, layout, name, diff)
            # Muon's update does not see a gradient's scale (nor, to its eps, AdamW's): the gradients do
            g, g_ref = run["grads"][name], ref_grads[name]
            assert (g - g_ref).norm() <= 1e-12 * g_ref.norm(), (routing, experts, layout, name)
