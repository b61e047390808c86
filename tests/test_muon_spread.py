"""Muon at scale: the batched iteration equals one matrix at a time, the iteration dtype, the owner
assignment, and (slow) real gloo processes at 2 and 4 ranks: FSDP2, HSDP (at 4) and DDP, spread and not,
equal one process (float64, 1e-6), with the bytes each rank receives counted around the collectives and
the Newton-Schulz work each rank runs."""

import pytest
import torch
from muon_spread_models import MODELS, OPTIMIZERS, batch, build, cases, muon_cfg

import recipe_runner as rr
from lmpretrain.update.muon_spread import owners, shard_rows, spread_decision
from lmpretrain.update.newton_schulz import iteration_dtype, newton_schulz, orthogonalise_all
from lmpretrain.update.optim import build_optimizer, describe_implementation


def test_batched_newton_schulz_equals_one_matrix_at_a_time():
    gen = torch.Generator().manual_seed(0)
    shapes = [
        (1, 8, 20),
        (3, 8, 20),
        (1, 20, 8),
        (2, 5, 5),
        (1, 8, 20),
        (1, 6, 9),
    ]  # a tall one joins (8, 20)
    mats = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes]
    batched = orthogonalise_all(mats, 5, torch.float64)
    for m, b in zip(mats, batched, strict=True):
        for i in range(m.size(0)):
            x = m[i] if m.size(-2) <= m.size(-1) else m[i].mT
            alone = newton_schulz(x.unsqueeze(0), 5)[0]
            alone = alone if m.size(-2) <= m.size(-1) else alone.mT
            assert b.shape == m.shape and (b[i] - alone).abs().max() < 1e-12
    # and it orthogonalises: the singular values of the result are near 1 (Muon's quintic keeps them in ~[0.7, 1.2])
    s = torch.linalg.svdvals(batched[0][0])
    assert s.min() > 0.6 and s.max() < 1.25


def test_polar_express_orthogonalises_better_than_the_quintic_in_five_steps():
    x = torch.randn(1, 64, 256, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    off = {
        name: (torch.linalg.svdvals(newton_schulz(x, 5, name)[0]) - 1).abs().max().item()
        for name in ("quintic", "polar_express")
    }
    # the quintic leaves singular values in ~[0.68, 1.13]; Polar Express's per-step coefficients ~[0.86, 1.14]
    assert off["quintic"] > 0.3 and off["polar_express"] < 0.15, off


def test_iteration_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert iteration_dtype("auto", torch.float32, cuda) == torch.bfloat16
    assert iteration_dtype("auto", torch.float32, cpu) == torch.float32
    assert iteration_dtype("auto", torch.float64, cuda) == torch.float64  # the equality tests keep float64
    assert iteration_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    assert iteration_dtype("float32", torch.float64, cpu) == torch.float32


def test_bfloat16_iteration_is_close_to_float32():
    model = build("llama").float()
    ids = batch(0)
    model(input_ids=ids, labels=ids).loss.backward()
    after = {}
    for dtype in ("float32", "bfloat16"):
        m = build("llama").float()
        for p, q in zip(m.parameters(), model.parameters(), strict=True):
            p.grad = q.grad.clone()
        build_optimizer(m, muon_cfg(muon_ns_dtype=dtype)).step()
        after[dtype] = m.model.layers[0].mlp.up_proj.weight
    start = model.model.layers[0].mlp.up_proj.weight
    f32, bf16 = (after[d] - start for d in ("float32", "bfloat16"))
    # bf16 rounds every product of the iteration (as torch.optim.Muon does): the same update to ~15%
    assert 0 < (bf16 - f32).norm() < 0.25 * f32.norm()
    assert torch.nn.functional.cosine_similarity(bf16.flatten(), f32.flatten(), dim=0) > 0.97


def test_owners_balance_bytes_and_shard_rows_follow_torch_chunk():
    assert owners([4, 4, 4, 4], 2) == [0, 1, 0, 1]
    assert owners([10, 1, 1, 1, 9], 2) == [0, 1, 0, 1, 1]  # largest first, to the least-loaded rank
    for n in (45, 3, 1, 8):
        for world in (2, 4):
            assert shard_rows(n, world) == [len(c) for c in torch.empty(n).chunk(world)] + [0] * (
                world - len(torch.empty(n).chunk(world))
            )


def test_the_start_up_line_says_which_runs():
    model = build("llama")
    opt = build_optimizer(model, muon_cfg())
    cpu = torch.device("cpu")
    line = describe_implementation(opt, muon_cfg(), cpu)
    assert line.endswith(
        "Muon: Newton-Schulz in float64 (optim.muon_ns_dtype=auto, optim.muon_coefficients=quintic), 3 batched "
        "iterations a step (one per matrix shape), foreach momentum and update; one process: every matrix here"
    )
    normuon = muon_cfg(name="normuon", muon_coefficients="polar_express")
    assert describe_implementation(build_optimizer(model, normuon), normuon, cpu, 2, sharded=True).endswith(
        "(two all-to-alls); then NorMuon normalises each rank's part of the results (its sums over the row "
        "shards: all-reduces of a few numbers per matrix)"
    )
    assert "spread over 4 ranks under FSDP2 (auto: it moves fewer bytes" in describe_implementation(
        opt, muon_cfg(), cpu, 4, sharded=True
    )
    assert "each of the 2 ranks orthogonalises every matrix" in describe_implementation(
        build_optimizer(model, muon_cfg(muon_spread="never")), muon_cfg(), cpu, 2
    )
    params = [p for g in opt.param_groups if g["kind"] == "muon" for p in g["params"]]
    groups = [g for g in opt.param_groups if g["kind"] == "muon" for _ in g["params"]]
    # the DDP roofline: these 32-wide float64 matrices spread on a CPU, not on a GPU (comm-bound there)
    assert spread_decision(params, groups, 2, False, cpu).ranks
    spread, _, why = spread_decision(params, groups, 2, False, torch.device("cuda"))
    assert not spread and why.startswith("not spread (optim.muon_spread=auto: Newton-Schulz ")
    # HSDP (2 replica groups x 2 shards): routed in the shard groups; over the replicas by the same roofline
    hsdp = spread_decision(params, groups, 4, True, cpu, replicas=2)
    assert hsdp.ranks and hsdp.replicas, hsdp
    assert hsdp.where.startswith("spread over the 2 ranks of each shard group under HSDP (auto: ")
    assert "and over the 2 replica groups (optim.muon_spread=auto: Newton-Schulz " in hsdp.where
    gpu = spread_decision(params, groups, 4, True, torch.device("cuda"), replicas=2)
    assert gpu.ranks and not gpu.replicas and "not over the 2 replica groups" in gpu.where


# ---- Real gloo processes (slow) -------------------------------------------------------------------


def one_process_reference() -> dict:
    """Each (model, optimizer)'s weights after the same two steps in this process (one rank)."""
    # A process group left in this process by an earlier test (once: the planner's fake 64 ranks) would
    # make this "one process" spread over ranks that do not exist.
    assert not torch.distributed.is_initialized(), "an earlier test left a process group initialised"
    weights = {}
    for model_type in MODELS:
        for name, settings in OPTIMIZERS.items():
            model = build(model_type)
            opt = build_optimizer(model, muon_cfg(**settings))
            for step in range(2):
                ids = batch(step)
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            weights[model_type, name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return weights


@pytest.fixture(scope="module")
def reference():
    return one_process_reference()


def launch(world: int, out) -> dict:
    rr.launch_ranks(rr.ROOT / "tests" / "muon_spread_worker.py", str(out), world=world, timeout=900)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_hsdp_and_ddp_spread_or_not_equal_one_process_and_fsdp2_receives_2_over_world(
    world, reference, tmp_path
):
    runs = launch(world, tmp_path / "runs.pt")
    assert len(runs) == len(MODELS) * len(cases(world))
    for (model_type, layout, spread, optimizer), run in runs.items():
        ref = reference[model_type, optimizer]
        for name, w in run["weights"].items():
            diff = ((w - ref[name]).norm() / ref[name].norm()).item()
            assert diff < 1e-6, (model_type, layout, spread, optimizer, name, diff)
        share = run["muon_bytes"] / world
        worst = max(max(steps) for steps in run["received"])  # bytes from other ranks, worst rank and step
        ops = run["funcol"][-1]  # every collective of the last step (CommDebugMode)
        # Newton-Schulz FLOPs of the last step: every rank's, and one process's (a rank that spreads nothing)
        work = [steps[-1] for steps in run["flops"]]
        whole = runs[model_type, "ddp", "never", "muon"]["flops"][0][-1]
        if spread == "always":  # each matrix orthogonalised once in the world, every rank doing a part
            assert sum(work) == whole and 0 < max(work) < whole, (model_type, layout, work, whole)
        else:
            assert work == [whole] * world
        if layout == "hsdp" and spread == "always":  # routed in the shard group, shared in the replica group
            shards = world // 2
            rest = dict(ops)
            assert rest.pop("c10d.alltoall_base_") == 2 and rest.pop("c10d._allgather_base_") >= 1, ops
            assert rest == ({} if optimizer == "muon" else {"c10d.allreduce_": 1}), ops  # NorMuon's sums
            assert run["calls"]["all_to_all_single"] == 2 and run["calls"]["all_gather_into_tensor"] >= 1
            # 2/shards of the matrices' bytes from the shard group, then the other replica's half of this
            # rank's owned matrices (padded to the larger half: at most the largest tensor more)
            bound = 2.2 * run["muon_bytes"] / shards + run["muon_bytes"] / shards / 2 + run["largest"]
            assert 0 < worst <= bound, (model_type, optimizer, worst / bound)
        elif layout == "fsdp2" and optimizer == "normuon":  # and one all-reduce of per-neuron sums
            assert ops == {"c10d.alltoall_base_": 2, "c10d.allreduce_": 1}, ops
            assert run["calls"] == {"all_to_all_single": 2, "all_reduce": 1}
            assert 0 < worst <= 2.2 * share, (model_type, worst / share)
        elif layout == "fsdp2" and spread == "always":  # two all-to-alls: no all-gather, no broadcast
            assert ops == {"c10d.alltoall_base_": 2} and run["calls"] == {"all_to_all_single": 2}
            assert 0 < worst <= 2.2 * share, (model_type, worst / share)
        elif layout == "ddp" and spread == "always":  # one all-gather of every rank's (padded) results
            assert ops == {"c10d._allgather_base_": 1} and run["calls"] == {"all_gather_into_tensor": 1}
            # whole tensors are balanced largest first: no rank's share exceeds the mean plus the largest
            assert 0 < worst <= (world - 1) * (share + run["largest"])
        elif layout in ("fsdp2", "hsdp"):  # not spread: each update gathered whole on every rank
            assert set(ops) == {"c10d_functional.all_gather_into_tensor"} and run["calls"] == {}
        else:  # DDP, not spread: every rank orthogonalises every matrix, nothing is sent
            assert ops == {} and run["calls"] == {}


def test_a_resume_with_another_spread_ns_dtype_or_coefficients_says_so_in_one_line():
    from lmpretrain.config import load_config
    from lmpretrain.update.optim import apply_hyperparameters
    from lmpretrain.update.schedule import hyperparameter_changes

    saved = load_config([str(rr.SMOKE), "--optim.name=normuon"])
    now = load_config(
        [str(rr.SMOKE), "--optim.name=normuon", "--optim.muon_spread=never", "--optim.muon_ns_dtype=float32",
         "--optim.muon_coefficients=polar_express", "--optim.normuon_beta2=0.9"]
    )  # fmt: skip
    line = hyperparameter_changes(saved.to_dict(), now, step=4, updates=4)
    assert line.startswith(
        "resumed with new hyper-parameters from step 4: optim.muon_ns_dtype auto -> float32, "
        "optim.muon_spread auto -> never, optim.muon_coefficients quintic -> polar_express, "
        "optim.normuon_beta2 0.95 -> 0.9 (lr "
    )
    assert "\n" not in line
    opt = build_optimizer(build("llama"), saved.optim)  # a loaded state brings the saved settings back
    apply_hyperparameters(opt, now.optim)
    muon = [g for g in opt.param_groups if g["kind"] == "muon"]
    assert {(g["ns_dtype"], g["spread"], g["coefficients"], g["normuon_beta2"]) for g in muon} == {
        ("float32", "never", "polar_express", 0.9)
    }
