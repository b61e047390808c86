"""Expert parallelism (model.ep_size) through transformers' DistributedConfig: what is refused before any
work, (slow) real gloo ranks with the experts split over ep_size=2 ranks training like one process
(float64, two Muon steps; routing as it comes and routing that leaves the second rank of each ep group no
token; 2 ranks, and 4 as FSDP2 and HSDP), and (slow) the recipe: 2 ranks (FSDP2) and 4 (HSDP) with
ep_size=2 equal one process over 10 steps, resume bit-identically after kill -9 and export a model
from_pretrained loads."""

import plan_check
import pytest
import torch
from moe_ep_models import QWEN3_MOE, ROUTINGS, batch, build, cases, muon_cfg
from transformers import AutoModelForCausalLM

import recipe_runner as rr
from lmpretrain.config import config_problems, load_config
from lmpretrain.layout import Layout
from lmpretrain.model.build import build_model_config
from lmpretrain.run.expert_parallel import ep_problems
from lmpretrain.update.optim import build_optimizer


def ep_problems_of(*args, kind="fsdp2", world=2, replicas=1) -> list[str]:
    cfg = load_config([str(rr.SMOKE), "--model.type=qwen3_moe", *args])
    return ep_problems(cfg, build_model_config(cfg.model), Layout(kind, world, replicas=replicas))


def test_what_expert_parallelism_cannot_run_is_refused_before_any_work():
    assert ep_problems_of("--model.ep_size=2") == []
    assert ep_problems_of("--model.ep_size=1", kind="ddp") == []
    assert ep_problems_of("--model.ep_size=2", kind="ddp") == [
        "model.ep_size=2 runs under FSDP2 or HSDP (the experts are sharded over the ranks), but this launch is "
        "ddp: launch with configs/accelerate/cpu-fsdp.yaml, fsdp.yaml or hsdp.yaml"
    ]
    # qwen3_moe's default: 128 experts
    assert ep_problems_of("--model.ep_size=3", world=3) == [
        "model.ep_size=3 must divide the model's 128 experts per layer"
    ]
    assert ep_problems_of("--model.ep_size=4", world=2) == [
        "model.ep_size=4 must divide the 2 ranks of a shard group"
    ]
    # HSDP: an ep group lies inside one shard group, found before the model is built
    assert ep_problems_of("--model.ep_size=4", world=4, replicas=2) == [
        "model.ep_size=4 must divide the 2 ranks of a shard group (2 replica groups x 2 shards)"
    ]
    llama = load_config([str(rr.SMOKE), "--model.ep_size=2"])
    assert ep_problems(llama, build_model_config(llama.model), Layout("fsdp2", 2)) == [
        "model.ep_size=2: transformers' llama config has no expert-parallel plan (base_model_ep_plan with an "
        "ep_dispatch_experts rule); set model.ep_size=1"
    ]
    assert "model.ep_size=0 must be >= 1" in " ".join(
        config_problems(load_config([str(rr.SMOKE), "--model.ep_size=0"]), 1)
    )


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


# ---- The recipe on real processes (slow) ----------------------------------------------------------

# The tiny Qwen3-MoE through the recipe: 4 experts, top-2, 2 layers, Muon (its per-expert matrices and
# momentum under EP), float64. One process takes 8 rows a micro-batch, 2 ranks 4, 4 ranks 2: the same rows.
# No load-balancing term: it is computed per micro-batch (as transformers does), so it would differ with the
# rows of a micro-batch; tests/test_routing.py trains it under FSDP2.
MOE = [
    "--model.type=qwen3_moe",
    "--train.moe_balance=none",
    *(f"--model.overrides.{k}={v}" for k, v in QWEN3_MOE.items() if k != "num_hidden_layers"),
    "--optim.name=muon",
    "--checkpoint.every=4",
]
TIMEOUT = 1200


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-1") / "run"
    return rr.run(out, *rr.EXACT, *MOE, "--train.micro_batch_size=8", timeout=TIMEOUT)


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-ep2") / "run"
    return rr.run(out, *rr.EXACT, *MOE, "--model.ep_size=2", launch="cpu-fsdp", timeout=TIMEOUT)


@pytest.mark.slow
def test_the_recipe_with_ep_2_on_2_ranks_trains_like_one_process_and_exports_a_plain_model(one_process, ep2):
    assert (
        "experts: batched_mm (one batched matmul per projection, float64; seen in a probe) in 2 "
        in ep2.output
    )
    assert (
        "expert parallelism: 2 MoE layers' 4 experts split over ep_size=2 ranks (2 each), tokens exchanged by "
        "all-to-all (transformers' DistributedConfig ep_implementation=all_to_all); each ep group's experts "
        "FSDP2-sharded over 1 rank(s); expert gradients summed over the ranks and divided by 2"
    ) in ep2.output
    assert "each rank orthogonalises only its own experts' matrices (12 of 24 here)" in ep2.output
    rr.assert_close_runs(one_process, ep2, rel=1e-9)
    # save_pretrained writes Qwen3-MoE's experts one by one (its hub layout); from_pretrained stacks them again
    final, alone = (
        AutoModelForCausalLM.from_pretrained(run.out / "final", dtype=torch.float64)
        for run in (ep2, one_process)
    )
    assert type(final).__name__ == "Qwen3MoeForCausalLM" and final.config.num_experts == 4
    assert final.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 2 * 16, 32)  # every expert, whole
    assert rr.rel_diff(final.state_dict(), alone.state_dict()) < 1e-9


@pytest.mark.slow
def test_the_recipe_with_ep_2_under_hsdp_on_4_ranks_trains_like_one_process(one_process, tmp_path):
    hsdp = rr.run(
        tmp_path / "hsdp", *rr.EXACT, *MOE, "--model.ep_size=2", "--train.micro_batch_size=2",
        launch="cpu-hsdp", timeout=TIMEOUT,
    )  # fmt: skip
    assert "FSDP2-sharded over 1 rank(s) x 2 replica groups; expert gradients summed over the ranks and " in (
        hsdp.output
    )
    rr.assert_close_runs(one_process, hsdp, rel=1e-9)
    assert_planned(hsdp, "cpu-hsdp", 4)


# The planner simulates expert parallelism with a balanced router (plan/balanced_routing.py); these runs
# route as they come, so the tokens' all-to-all differs from the plan by how unevenly the (token, expert)
# pairs cross the ranks at step 2: measured 3.6% (2 ranks) to 5.9% (4 ranks) more bytes planned than sent.
# Every other figure is compared as in plan_check (bytes held exactly, the rest within 2%, the peak 10%).
ROUTING_TOLERANCE = 0.10


def assert_planned(run, launch: str, world: int) -> None:
    figures, off = plan_check.compare(run, launch, world)
    planned, sent = figures["all_to_all"]
    assert sent > 0 and abs(planned - sent) <= ROUTING_TOLERANCE * sent, figures
    assert set(off) <= {"all_to_all"}, figures


@pytest.mark.slow
def test_the_plan_of_the_ep_run_holds_sends_and_peaks_as_it_did(ep2):
    assert_planned(ep2, "cpu-fsdp", 2)


@pytest.mark.slow
def test_the_plan_of_ep_2_over_4_fsdp2_ranks_with_checkpointing_is_the_real_step(tmp_path):
    """Each ep group's experts FSDP2-sharded over efsdp=2 ranks; the recomputed forward repeats the all-to-alls."""
    run = rr.run(
        tmp_path / "run", *rr.EXACT, *MOE, "--model.ep_size=2", "--train.micro_batch_size=2",
        "--data.num_streams=4", "--train.activation_checkpointing=full", "--optim.name=adamw",
        "--train.max_steps=3", "--optim.warmup_steps=1", "--eval.every=0", "--checkpoint.every=0",
        launch="cpu-fsdp", launch_args=["--num_processes", "4"], timeout=TIMEOUT,
    )  # fmt: skip
    assert "each ep group's experts FSDP2-sharded over 2 rank(s)" in run.output
    assert_planned(run, "cpu-fsdp", 4)


@pytest.mark.slow
def test_kill_9_then_resume_with_ep_2_is_bit_identical(ep2, tmp_path):
    """Sharded (DCP) checkpoints of the experts' DTensors, their Muon momentum included."""
    args = [*rr.EXACT, *MOE, "--model.ep_size=2"]
    _, resumed = rr.killed_then_resumed(tmp_path / "killed", args, "cpu-fsdp", TIMEOUT)
    rr.assert_bit_identical(ep2, resumed)
    assert "checkpoints: format=sharded" in resumed.output
