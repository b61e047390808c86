"""μP by width and depth (model.mup, model/mup.py): what it changes at a width and a depth, nothing at the base
width and depth, an export that computes what the μP model computes, and the optimizer's lr per group."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import recipe_runner as rr
from lmpretrain.config import OptimConfig, config_problems, load_config
from lmpretrain.errors import ConfigError
from lmpretrain.model import mup
from lmpretrain.update.optim import build_optimizer
from lmpretrain.update.schedule import set_lr


def llama(width: int, heads: int = 4, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=heads, vocab_size=97, tie_word_embeddings=True, **kw,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64)


IDS = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("rule", [None, "completep", "sqrt"])
def test_at_the_base_width_the_model_and_its_optimizer_are_the_plain_ones(rule):
    """At width 64 over 64 (and, with a depth rule, 2 layers over a base of 2) every multiplier is 1."""
    plain, scaled = llama(64), llama(64)
    record = mup.apply(scaled, base_width=64, depth_rule=rule, base_depth=2 if rule else None)
    assert record.mult == 1 and not record.queries and record.branch_mult == 1 and record.depth_lr_mult() == 1
    assert all(not m._forward_hooks for m in scaled.modules())
    for (name, a), b in zip(plain.state_dict().items(), scaled.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(plain(IDS).logits, scaled(IDS).logits)
    cfg = OptimConfig(lr=1e-3)
    groups = [
        [(g["name"], len(g["params"])) for g in build_optimizer(m, cfg).param_groups] for m in (plain, scaled)
    ]
    assert groups[0] == groups[1]


def test_at_4x_the_base_width():
    """Width 256 over base 64 with 4 heads (the head count taken as fixed, so d_head grows 16 -> 64): hidden
    matrices' init / 2, logits / 4, attention scores sqrt(16) / 64 instead of 1 / sqrt(64)."""
    plain, scaled = llama(256), llama(256)
    record = mup.apply(scaled, base_width=64)
    assert record.mult == 4
    embeddings = {id(scaled.get_input_embeddings().weight)}
    for (name, a), b in zip(plain.named_parameters(), scaled.parameters(), strict=True):
        expected = a / 2 if b.dim() >= 2 and id(b) not in embeddings else a
        assert torch.equal(expected, b), name
    assert scaled.model.layers[0].self_attn.scaling == 4 / 64
    assert set(record.queries) == {f"model.layers.{i}.self_attn.q_proj" for i in range(2)}
    # the logits are the head of the final norm's output / 4
    hidden = scaled.model(IDS).last_hidden_state
    plain_norm = scaled.model.norm._forward_hooks.copy()
    scaled.model.norm._forward_hooks.clear()
    unscaled = scaled.model(IDS).last_hidden_state
    scaled.model.norm._forward_hooks.update(plain_norm)
    assert torch.equal(hidden, unscaled * 0.25)
    assert torch.equal(scaled(IDS).logits, scaled.lm_head(hidden))


@pytest.mark.parametrize(
    "head_dim,rule",
    [(None, None), (16, None), (16, "completep"), (None, "sqrt")],
    ids=["head-width-grows", "head-width-fixed", "completep-with-biases", "sqrt-head-width-grows"],
)
def test_the_export_is_a_plain_model_that_computes_the_mup_models_logits(head_dim, rule):
    """The depth rules at 2 layers over a base of 8 (branches x 4 and x 2), with projection biases under
    CompleteP so that their folding counts too."""
    extra = {"head_dim": head_dim} if head_dim else {}
    if rule == "completep":
        extra |= {"attention_bias": True, "mlp_bias": True}
    scaled = llama(256, 4 if head_dim is None else 16, **extra)
    if rule == "completep":  # transformers initialises biases to 0: give them values the fold must scale
        with torch.no_grad():
            for name, p in scaled.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    mup.apply(scaled, base_width=64, head_dim_fixed=head_dim is not None, depth_rule=rule, base_depth=8)
    plain = llama(256, 4 if head_dim is None else 16, **extra)
    plain.load_state_dict(mup.of(scaled).fold_for_export(scaled.state_dict()))
    assert torch.allclose(plain(IDS).logits, scaled(IDS).logits, rtol=1e-12, atol=1e-12)


def test_a_head_width_fixed_by_the_config_is_left_alone():
    scaled = llama(256, 4, head_dim=16)  # 4 heads of 16 whatever the width
    record = mup.apply(scaled, base_width=64, head_dim_fixed=True)
    assert not record.queries and scaled.model.layers[0].self_attn.scaling == 16**-0.5


def test_adamw_trains_the_hidden_matrices_at_lr_over_m_and_muon_keeps_its_spectral_scale():
    scaled = llama(256)
    record = mup.apply(scaled, base_width=64)
    adamw = build_optimizer(scaled, OptimConfig(lr=1e-3))
    set_lr(adamw, 1e-3)
    lrs = {g["name"]: g["lr"] for g in adamw.param_groups}
    assert lrs == {"decay_mup_hidden": 1e-3 / 4, "no_decay": 1e-3}  # every decaying matrix is hidden here
    hidden = next(g for g in adamw.param_groups if g["name"] == "decay_mup_hidden")
    assert {id(p) for p in hidden["params"]} == record.hidden
    for scale, mult in (("match_rms_adamw", 0.5), ("original", 1.0)):
        muon = build_optimizer(scaled, OptimConfig(name="muon", lr=1e-3, muon_lr_scale=scale))
        set_lr(muon, 1e-3)
        assert {g["lr"] for g in muon.param_groups if g.get("kind") == "muon"} == {1e-3 * mult}, scale


@pytest.mark.parametrize("kind", ["qwen3", "gemma"])
def test_the_depth_rules_export_folds_for_other_decoders(kind):
    """Qwen3 (query/key norms) and Gemma ((1 + weight) norms) name their branches' last projections as Llama
    does: 2 layers over a base of 8 under CompleteP, exported, computes what the μP model computes."""

    def build():
        torch.manual_seed(0)
        config = AutoConfig.for_model(
            kind, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=97,
        )  # fmt: skip
        config._attn_implementation = "eager"
        return AutoModelForCausalLM.from_config(config, dtype=torch.float64)

    scaled = build()
    record = mup.apply(scaled, base_width=32, head_dim_fixed=True, depth_rule="completep", base_depth=8)
    assert len(record.branches) == 4 and record.branch_mult == 4
    plain = build()
    plain.load_state_dict(record.fold_for_export(scaled.state_dict()))
    assert torch.allclose(plain(IDS).logits, scaled(IDS).logits, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rule,branch,lr", [("completep", 4.0, 1.0), ("sqrt", 2.0, 2.0)])
def test_a_depth_rule_scales_each_residual_branch_and_the_decoder_layers_lr(rule, branch, lr):
    """2 layers over a base of 8: each o_proj/down_proj output (what joins the residual stream) is measured x
    (8/2)^alpha against its own linear map of its input, and the decoder layers train at lr x (8/2)^(1-alpha)."""
    scaled = llama(256)
    record = mup.apply(scaled, base_width=64, depth_rule=rule, base_depth=8)
    names = {f"model.layers.{i}.{b}" for i in range(2) for b in ("self_attn.o_proj", "mlp.down_proj")}
    assert set(record.branches) == names and record.branch_mult == branch
    ratios = {}
    for name in names:
        module = scaled.get_submodule(name)
        module.register_forward_hook(
            lambda m, args, out, name=name: ratios.__setitem__(
                name, (out.norm() / torch.nn.functional.linear(args[0], m.weight).norm()).item()
            )
        )
    scaled(IDS)
    assert ratios == pytest.approx(dict.fromkeys(names, branch), rel=1e-12)
    adamw = build_optimizer(scaled, OptimConfig(lr=1e-3))
    set_lr(adamw, 1e-3)
    groups = {g["name"]: (g["lr"], len(g["params"])) for g in adamw.param_groups}
    # a layer's 7 matrices and 2 norms take the depth's lr, the embeddings and the final norm keep lr
    if lr == 1:  # CompleteP: the width's groups
        expected = {"decay_mup_hidden": (1e-3 / 4, 14), "no_decay": (1e-3, 6)}
    else:
        expected = {
            "decay_mup_hidden_depth": (1e-3 / 4 * lr, 14),
            "no_decay": (1e-3, 2),
            "no_decay_mup_depth": (1e-3 * lr, 4),
        }
    assert {k: n for k, (_, n) in groups.items()} == {k: n for k, (_, n) in expected.items()}
    assert {k: v for k, (v, _) in groups.items()} == pytest.approx({k: v for k, (v, _) in expected.items()})
    muon = build_optimizer(scaled, OptimConfig(name="muon", lr=1e-3, muon_lr_scale="original"))
    set_lr(muon, 1e-3)
    muon_lrs = [g["lr"] for g in muon.param_groups if g.get("kind") == "muon"]
    assert muon_lrs and muon_lrs == pytest.approx([1e-3 * lr] * len(muon_lrs))
    assert f"depth 2 over base 8 ({rule}): residual branches x {branch:g} (4 o_proj/down_proj outputs)" in (
        record.describe()
    )


def test_what_mup_cannot_do_is_refused_with_the_reason(tmp_path):
    gpt2 = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("gpt2", n_embd=128, n_layer=1, n_head=4, vocab_size=97)
    )
    with pytest.raises(ConfigError, match="has no q_proj to fold 1/d_head into"):
        mup.apply(gpt2, base_width=64)
    with pytest.raises(
        ConfigError, match="GPT2Block has no linear o_proj ending each of its attention branches"
    ):
        mup.apply(gpt2, base_width=128, depth_rule="completep", base_depth=1)
    small = dict(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, vocab_size=97
    )
    gemma2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma2", intermediate_size=128, **small))
    with pytest.raises(
        ConfigError, match="Gemma2DecoderLayer normalises each branch's output before the residual"
    ):
        mup.apply(gemma2, base_width=64, depth_rule="completep", base_depth=1)
    moe = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(
            "qwen3_moe", moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, **small
        )
    )
    with pytest.raises(ConfigError, match=r"no linear down_proj .* \(found: \['mlp.experts.down_proj'\]\)"):
        mup.apply(moe, base_width=64, depth_rule="completep", base_depth=1)
    cfg = load_config([str(rr.SMOKE), "--model.mup.base_width=0", "--model.pretrained=gpt2"])
    problems = config_problems(cfg, 1)
    assert "model.mup.base_width=0 must be >= 1 (the width the lr was tuned at)" in problems
    assert any(p.startswith("model.mup changes the initialisation") for p in problems)
    for depth, problem in (
        (["--model.mup.depth=sqrt"], "model.mup.depth=sqrt needs model.mup.base_depth (the number of layers"),
        (["--model.mup.base_depth=4"], "model.mup.base_depth=4 does nothing without model.mup.depth"),
        (["--model.mup.depth=completep", "--model.mup.base_depth=0"], "model.mup.base_depth=0 must be >= 1"),
        (
            [
                "--model.mup.depth=sqrt",
                "--model.mup.base_depth=2",
                "--train.fp8=rowwise",
                "--train.compile=true",
            ],
            "model.mup.depth scales the o_proj/down_proj outputs by forward hooks, which train.fp8=rowwise would drop",
        ),
    ):
        problems = config_problems(load_config([str(rr.SMOKE), "--model.mup.base_width=64", *depth]), 1)
        assert len(problems) == 1 and problems[0].startswith(problem), problems
    with pytest.raises(ConfigError, match="model.mup.depth='cubic' must be one of completep, sqrt"):
        load_config([str(rr.SMOKE), "--model.mup.base_width=64", "--model.mup.depth=cubic"])


@pytest.mark.slow
def test_the_recipe_at_the_base_width_is_bit_identical_to_a_run_without_mup(tmp_path):
    """smoke.yaml (hidden 64, 2 layers) with model.mup.base_width=64 and CompleteP's depth rule at
    base_depth=2 through the recipe: every logged number and the final weights equal a run without it
    (float64)."""
    plain = rr.run(tmp_path / "plain", *rr.EXACT)
    depth = ["--model.mup.depth=completep", "--model.mup.base_depth=2"]
    scaled = rr.run(tmp_path / "mup", *rr.EXACT, "--model.mup.base_width=64", *depth)
    assert "μP: width 64 over base 64 (m = 1)" in scaled.output
    assert (
        "depth 2 over base 2 (completep): residual branches x 1 (4 o_proj/down_proj outputs)" in scaled.output
    )
    rr.assert_bit_identical(plain, scaled)


@pytest.mark.slow
def test_a_sweep_runs_each_width_and_value_once_and_reports_the_best(tmp_path):
    """scripts/sweep.py on smoke.yaml: 2 widths x 2 lrs as parallel recipe runs, the best lr per width from
    each run's final held-out loss; run again, nothing is redone; then 2 depths at one width and lr."""
    import json
    import subprocess
    import sys

    sweep = [sys.executable, str(rr.ROOT / "scripts" / "sweep.py"), str(rr.SMOKE), "--parallel", "2"]
    runs = [
        "--",
        "--train.max_steps=6",
        "--optim.warmup_steps=1",
        "--eval.every=6",
        "--model.mup.base_width=64",
    ]
    cmd = [*sweep, "--values", "1e-3,8e-3", "--widths", "64,128", "--out", str(tmp_path), *runs]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    table = json.loads((tmp_path / "sweep.json").read_text())
    assert set(table) == {"64", "128"} and all(set(t) == {"1e-3", "8e-3"} for t in table.values())
    for width, losses in table.items():
        best = min(losses, key=losses.get)
        assert f"best optim.lr={best} ({losses[best]:.4f})" in first.stdout, width
    assert "μP: width 128 over base 64 (m = 2)" in (tmp_path / "w128-lr8e-3" / "sweep.log").read_text()
    assert (tmp_path / "sweep.png").stat().st_size > 0
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert "[sweep] 4 runs, 4 already finished, 0 to run" in again.stdout
    assert json.loads((tmp_path / "sweep.json").read_text()) == table
    # --depths: each depth its own run and row, its num_hidden_layers reaching the model (CompleteP over 2)
    deep = tmp_path / "depths"
    by_depth = [*sweep, "--values", "8e-3", "--widths", "64", "--depths", "1,2", "--out", str(deep), *runs]
    by_depth += ["--model.mup.depth=completep", "--model.mup.base_depth=2"]
    third = subprocess.run(by_depth, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stdout + third.stderr
    assert set(json.loads((deep / "sweep.json").read_text())) == {"64-d1", "64-d2"}
    assert "width    64, depth  1: 8e-3: " in third.stdout
    log = (deep / "w64-d1-lr8e-3" / "sweep.log").read_text()
    assert "depth 1 over base 2 (completep): residual branches x 2 (2 o_proj/down_proj outputs)" in log
