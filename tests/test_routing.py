"""A mixture of experts' routing (model/routing.py): the load-balancing loss as an objective term equal to
the model's own, the router z-loss, the expert loads counted as the experts really ran (not recomputation,
not evaluation), DeepSeek-V3's bias balancing, and what a model cannot do refused with the setting to change."""

import pytest
import torch
from moe_ep_models import QWEN3_MOE
from test_experts import TINY, VOCAB, tiny
from transformers import AutoConfig, AutoModelForCausalLM

import recipe_runner as rr
from lmpretrain.errors import ConfigError
from lmpretrain.model.objective import LMObjective, weighted_sum
from lmpretrain.model.routing import ExpertLoad
from lmpretrain.model.speed import enable_activation_checkpointing

# A DeepSeek-V3 of 2 MoE layers, 4 routed experts in 2 groups, 2 per token, one shared expert.
DEEPSEEK = {
    "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_group": 2, "topk_group": 2, "n_shared_experts": 1, "first_k_dense_replace": 0, "kv_lora_rank": 16,
    "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
}  # fmt: skip


def deepseek(dtype=torch.float64):
    torch.manual_seed(0)
    config = AutoConfig.for_model("deepseek_v3", vocab_size=VOCAB, **DEEPSEEK)
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation="batched_mm")


def rows(seed=1, n=3, length=12):
    ids = torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))
    return ids, ids.clone()


class _OneRank:
    """What ExpertLoad asks of the accelerator, for one process: a reduction over one rank is the identity."""

    @staticmethod
    def reduce(tensor, reduction):
        return tensor.clone()


def CountedLoad(model, balance="aux_loss", rate=0.001):
    return ExpertLoad(model, balance, rate, every=1, accelerator=_OneRank())


@pytest.mark.parametrize("model_type", list(TINY))
@pytest.mark.parametrize("loss_impl", ["full", "chunked"])
def test_the_router_aux_term_is_the_models_own_load_balancing_loss_and_trains_like_it(model_type, loss_impl):
    """transformers' CausalLM with labels trains mean cross-entropy + router_aux_loss_coef * its
    load-balancing loss: the objective's weighted terms over the targets are that, value and gradient."""
    model = tiny(model_type, "batched_mm")
    objective = LMObjective(loss_impl=loss_impl)
    lines = objective.install(model)
    assert any("load-balancing loss" in line and "train/router_aux" in line for line in lines)
    ids, labels = rows()
    terms = objective(model, ids, labels)
    count = terms["loss"].count
    (weighted_sum(terms) / count).backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    theirs = type(model).forward(model, input_ids=ids, labels=labels, output_router_logits=True)
    theirs.loss.backward()
    assert terms["router_aux"].weight == model.config.router_aux_loss_coef > 0
    assert (terms["router_aux"].sum / count).item() == pytest.approx(theirs.aux_loss.item(), rel=1e-12)
    assert theirs.aux_loss.item() > 1.0  # E * sum f P >= 1, with equality only for an even load
    router = next(n for n in ours if n.endswith("gate.weight"))
    assert ours[router].norm() > 0
    # transformers' cross-entropy runs in float32 (its loss_utils cast the logits): ~1e-7 from float64's
    for name, grad in ours.items():
        reference = model.get_parameter(name).grad
        assert (grad - reference).norm() <= 1e-6 * reference.norm(), name


def test_the_router_z_loss_is_the_mean_squared_logsumexp_of_the_router_logits_and_reaches_the_routers():
    model = tiny("qwen3_moe", "batched_mm")
    objective = LMObjective(moe_balance="none", router_z_loss=0.01, router_aux_loss_coef=0.5)
    objective.install(model)
    ids, labels = rows()
    terms = objective(model, ids, labels)
    assert "router_aux" not in terms
    logits = model.model(input_ids=ids, output_router_logits=True).router_logits
    expected = torch.stack([torch.logsumexp(layer, -1).square().mean() for layer in logits]).mean()
    z = terms["router_z"]
    assert z.weight == 0.01 and (z.sum / z.count).item() == pytest.approx(expected.item(), rel=1e-12)
    z.sum.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.norm() > 0


def test_the_held_out_objective_scores_the_router_terms_too():
    model = tiny("olmoe", "batched_mm")
    objective = LMObjective(router_z_loss=0.1)
    objective.install(model)
    with torch.no_grad():
        terms = objective.held_out()(model, *rows())
    assert {"loss", "router_aux", "router_z"} <= set(terms)


def test_a_dense_model_has_no_router_terms_and_no_load():
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=VOCAB, **{k: TINY["qwen3_moe"][k] for k in ("hidden_size",)},
                                  num_hidden_layers=1, num_attention_heads=4, intermediate_size=48)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    objective = LMObjective(router_z_loss=0.1)
    assert not any("expert" in line for line in objective.install(model))
    assert set(objective(model, *rows())) == {"loss"}
    assert ExpertLoad.for_run(model, None, None) is None


def test_what_a_models_routers_cannot_do_is_refused_with_the_setting_to_change():
    with pytest.raises(ConfigError, match=r"moe_balance=aux_loss: transformers has no load-balancing loss for "
                       r"deepseek_v3; its routers have a selection bias: use train.moe_balance=bias"):  # fmt: skip
        LMObjective().install(deepseek())
    with pytest.raises(ConfigError, match=r"moe_balance=bias: qwen3_moe's routers have no per-expert selection "
                       r"bias \(e_score_correction_bias\)"):  # fmt: skip
        LMObjective(moe_balance="bias").install(tiny("qwen3_moe", "batched_mm"))


def routed(model, ids) -> torch.Tensor:
    """Tokens per expert per layer from the router logits, as the softmax top-k routers pick them."""
    logits = model.model(input_ids=ids, output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    return torch.stack(
        [torch.bincount(layer.topk(k, -1).indices.flatten(), minlength=layer.shape[-1]) for layer in logits]
    )


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_the_expert_load_counts_each_training_forward_once(checkpointing):
    model = tiny("mixtral", "batched_mm")
    objective = LMObjective()
    objective.install(model)
    ids, labels = rows()
    with torch.no_grad():
        expected = routed(model, ids)
    enable_activation_checkpointing(model, checkpointing)
    model.train()
    load = CountedLoad(model)
    weighted_sum(objective(model, ids, labels)).backward()  # recomputed in backward under checkpointing
    with torch.no_grad():
        objective(model, ids, labels)  # evaluation: not counted
    load.step_done(stepped=True)
    assert torch.equal(load._window, expected)
    assert expected.sum().item() == 2 * 36 * 2  # layers x tokens x experts per token
    metrics = load.metrics(step=1, final=False)
    fractions = expected.double() / expected.sum(1, keepdim=True)
    assert metrics["moe/load_max"] == pytest.approx(fractions.max().item() * 4)
    assert metrics["moe/load_cv"] == pytest.approx((fractions.std(1, correction=0) / 0.25).mean().item())
    assert metrics["moe/load/layer_1"] == pytest.approx(fractions[1].tolist())
    assert metrics["moe/load_max"] > 1.0  # uneven at init
    assert load._window.sum() == 0  # a new window


def test_bias_balancing_moves_each_experts_bias_toward_its_layers_mean_load():
    model = deepseek()
    objective = LMObjective(moe_balance="bias")
    lines = objective.install(model)
    assert any("e_score_correction_bias moves" in line for line in lines)
    ids, labels = rows()
    load = CountedLoad(model, balance="bias", rate=0.01)
    assert len(load.biases) == 2 and all(b.abs().sum() == 0 for b in load.biases)
    terms = objective(model, ids, labels)
    assert set(terms) == {"loss"}  # no loss term: the bias does the balancing
    counts = load._step.clone()
    load.step_done(stepped=True)
    for bias, c in zip(load.biases, counts, strict=True):
        c = c.to(bias.dtype)  # transformers keeps the bias in float32 (_keep_in_fp32_modules_strict)
        torch.testing.assert_close(bias, 0.01 * torch.sign(c.mean() - c), rtol=0, atol=0)
        assert (bias != 0).any()
    assert "e_score_correction_bias" in "".join(model.state_dict())  # checkpoints hold the biases
    before = [b.clone() for b in load.biases]
    objective(model, ids, labels)
    load.step_done(stepped=False)  # a skipped update moves nothing
    assert all(torch.equal(a, b) for a, b in zip(before, load.biases, strict=True))


# ---- The recipe on real processes (slow) ----------------------------------------------------------

# The tiny Qwen3-MoE through the recipe (4 experts, top-2), float64, on 2 FSDP2 ranks: the load-balancing
# term (weight 0.01) and a router z-loss with the chunked loss.
ROUTED = [
    "--model.type=qwen3_moe",
    *(f"--model.overrides.{k}={v}" for k, v in QWEN3_MOE.items() if k != "num_hidden_layers"),
    "--train.router_aux_loss_coef=0.01",
    "--train.router_z_loss=0.001",
    "--train.loss_impl=chunked",
    "--checkpoint.every=4",
    "--logging.every=5",
]
ROUTER_KEYS = ("train/router_aux", "train/router_z", "eval/router_aux", "moe/load_max", "moe/load_cv")


@pytest.fixture(scope="module")
def routed_fsdp(tmp_path_factory):
    return rr.run(
        tmp_path_factory.mktemp("routed") / "run", *rr.EXACT, *ROUTED, launch="cpu-fsdp", timeout=900
    )


@pytest.mark.slow
def test_the_router_terms_train_under_fsdp2_and_the_loads_are_logged(routed_fsdp):
    assert "experts balanced by the load-balancing loss (modeling_qwen3_moe.load_balancing_loss_func" in (
        routed_fsdp.output
    )
    rows = {r["step"]: r for r in routed_fsdp.metrics()}
    for step in range(1, 11):
        assert rows[step]["train/router_aux"] >= 1.0  # E * sum_e f_e P_e: 1 at an even load
        assert rows[step]["train/router_z"] > 0
    assert "eval/router_aux" in rows[5] and "eval/router_aux" in rows[10]
    for step in (5, 10):  # every logging.every steps: the window's loads over both ranks
        shares = [rows[step][f"moe/load/layer_{i}"] for i in range(2)]
        assert all(sum(layer) == pytest.approx(1.0) and len(layer) == 4 for layer in shares)
        assert rows[step]["moe/load_max"] == pytest.approx(4 * max(max(layer) for layer in shares))
    assert "moe/load_max" not in rows[4]


@pytest.mark.slow
def test_kill_9_then_resume_with_the_router_terms_is_bit_identical(routed_fsdp, tmp_path):
    _, resumed = rr.killed_then_resumed(tmp_path / "killed", [*rr.EXACT, *ROUTED], "cpu-fsdp", 900)
    rr.assert_bit_identical(routed_fsdp, resumed)
    for x, y in zip(routed_fsdp.metrics(), resumed.metrics(), strict=True):
        assert [x.get(k) for k in ROUTER_KEYS] == [y.get(k) for k in ROUTER_KEYS], x["step"]


BIASED = [
    "--model.type=deepseek_v3",
    *(f"--model.overrides.{k}={v}" for k, v in DEEPSEEK.items()),
    "--train.moe_balance=bias",
    "--train.moe_bias_rate=0.01",
]


@pytest.mark.slow
def test_bias_balancing_on_2_fsdp2_ranks_equals_one_process(tmp_path):
    alone = rr.run(tmp_path / "one", *rr.EXACT, *BIASED, "--train.micro_batch_size=8", timeout=900)
    fsdp = rr.run(tmp_path / "two", *rr.EXACT, *BIASED, launch="cpu-fsdp", timeout=900)
    assert "e_score_correction_bias moves by train.moe_bias_rate" in fsdp.output
    # DeepSeek-V3's router computes its scores in float32 whatever the weights' dtype (modeling_deepseek_v3:
    # `hidden_states.type(torch.float32)`): float64 runs agree to float32's rounding there, not to 1e-15
    rr.assert_close_runs(alone, fsdp, rel=1e-6)
    for x, y in zip(alone.metrics(), fsdp.metrics(), strict=True):  # the loads the biases move on: exact
        assert x.get("moe/load_max") == y.get("moe/load_max") and x.get("moe/load_cv") == y.get("moe/load_cv")
    biases = {k: v for k, v in fsdp.weights().items() if k.endswith("e_score_correction_bias")}
    assert len(biases) == 2 and all(b.abs().sum() > 0 for b in biases.values())  # they moved, and were saved
    for key, bias in biases.items():
        assert torch.equal(bias, alone.weights()[key]), key
        # 10 updates of +-0.01 (or 0 for an expert exactly at the mean): a multiple of 0.01 within 10 of them
        steps = bias.double() / 0.01
        assert (steps - steps.round()).abs().max() < 1e-4 and steps.abs().max() <= 10
