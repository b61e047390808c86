"""Muon (optim.name=muon): which parameters it updates, its step against a float64 reference computed
here from the algorithm's definition, the config checks, a resume that switches muon <-> normuon, and
(slow) the recipe with NorMuon under DDP and FSDP2 on real gloo processes: 2 ranks = 1 rank, FSDP2 = DDP,
kill -9 + resume bit-identical, a sharded checkpoint resumed on 1 process."""

import copy
import dataclasses
import math
import shutil

import plan_check
import pytest
import torch
from conftest import TINY_MIXTRAL
from transformers import AutoConfig, AutoModelForCausalLM

import recipe_runner as rr
from lmpretrain.config import OptimConfig, config_problems, load_config
from lmpretrain.errors import ConfigError
from lmpretrain.layout import Layout
from lmpretrain.plan.launch import read_launch
from lmpretrain.update import muon_problems, set_lr
from lmpretrain.update.muon import MuonAdamW
from lmpretrain.update.optim import apply_hyperparameters, build_optimizer, describe_groups

TINY = {
    "llama": {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    },
    "gpt2": {
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 64,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
    "mixtral": TINY_MIXTRAL,
    "gpt_oss": {  # experts stored (experts, in, out) with per-expert bias stacks (experts, width)
        "hidden_size": 32,
        "intermediate_size": 24,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_local_experts": 3,
        "num_experts_per_tok": 2,
        "layer_types": ["full_attention"],
    },
}
VOCAB = 96


def tiny(model_type: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, **TINY[model_type])
    config._attn_implementation = "eager"
    # float64: the eager expert loop (the grouped-matmul kernel takes no float64)
    extra = {"experts_implementation": "eager"} if model_type in ("mixtral", "gpt_oss") else {}
    return AutoModelForCausalLM.from_config(config, **extra).double()


def muon_cfg(**kw) -> OptimConfig:
    return OptimConfig(**{"name": "muon", "lr": 0.01, "weight_decay": 0.1, **kw})


def names_in(optimizer, model, kind: str) -> set[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for g in optimizer.param_groups if g["kind"] == kind for p in g["params"]}


# ---- Which parameters Muon updates ----------------------------------------------------------------


def test_llama_block_matrices_on_muon_the_rest_on_adamw():
    model = tiny("llama")
    opt = build_optimizer(model, muon_cfg())
    muon, adamw = names_in(opt, model, "muon"), names_in(opt, model, "adamw")
    assert muon == {
        f"model.layers.{i}.{m}.weight"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
        + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    }
    # embeddings, the (untied) output head and every norm stay on AdamW
    assert adamw == {n for n, _ in model.named_parameters()} - muon
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= adamw
    line = describe_groups(opt)
    n_muon = sum(p.numel() for n, p in model.named_parameters() if n in muon)
    assert line.startswith(f"Muon: 14 matrices in 14 tensors, {n_muon:,} params (Nesterov momentum 0.95, 5 ")
    assert (
        "AdamW decay: 1 tensors" in line and "AdamW no_decay: 6 tensors" in line
    )  # lm_head; embed + 5 norms


def test_gpt2_fused_qkv_is_split_in_three_and_conv1d_is_read_as_in_out():
    model = tiny("gpt2")
    opt = build_optimizer(model, muon_cfg())
    groups = {g["name"]: g for g in opt.param_groups}
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in groups["muon_in_out_fused3"]["params"]} == {
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.1.attn.c_attn.weight",
    }
    assert {names[id(p)] for p in groups["muon_in_out"]["params"]} == {
        f"transformer.h.{i}.{m}.weight" for i in range(2) for m in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    adamw = names_in(opt, model, "adamw")
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.attn.c_attn.bias"} <= adamw
    assert "12 matrices in 8 tensors, 2 fused QKV split per projection" in describe_groups(opt)


def test_mixtral_expert_stacks_are_batches_of_matrices_gate_up_split_router_on_adamw():
    model = tiny("mixtral")
    opt = build_optimizer(model, muon_cfg())
    muon = names_in(opt, model, "muon")
    experts = {n for n, p in model.named_parameters() if p.dim() == 3}
    assert experts and experts <= muon  # gate_up_proj and down_proj: (experts, rows, cols)
    assert "model.layers.0.mlp.gate.weight" in names_in(opt, model, "adamw")  # the router: (experts, hidden)
    # 4 attention projections + 3 experts' gate and up (split) + 3 experts' down
    line = describe_groups(opt)
    assert line.startswith("Muon: 13 matrices in 6 tensors, 1 expert gate_up stacks split into gate and up ")
    by_group = {g["name"]: names_in_group(g, model) for g in opt.param_groups if g["kind"] == "muon"}
    assert by_group["muon_fused2"] == ["model.layers.0.mlp.experts.gate_up_proj"]  # (experts, 2 x 24, 32)


def test_gpt_oss_bias_stacks_and_router_stay_on_adamw_its_experts_are_in_out_gate_up_interleaved():
    model = tiny("gpt_oss")
    opt = build_optimizer(model, muon_cfg())
    names = {id(p): n for n, p in model.named_parameters()}
    layer = "model.layers.0."
    by_group = {g["name"]: {names[id(p)] for p in g["params"]} for g in opt.param_groups}
    assert by_group["muon_in_out"] == {layer + "mlp.experts.down_proj"}
    # (experts, in, 2 x out): gate and up alternate along the outputs (GPT-OSS's experts are not concatenated)
    assert by_group["muon_in_out_fused2_interleaved"] == {layer + "mlp.experts.gate_up_proj"}
    assert by_group["muon"] == {
        layer + m + ".weight"
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    }
    adamw = names_in(opt, model, "adamw")
    assert {layer + "mlp.experts.gate_up_proj_bias", layer + "mlp.experts.down_proj_bias"} <= adamw
    assert {layer + "self_attn.sinks", layer + "mlp.router.weight", layer + "mlp.router.bias"} <= adamw


# ---- The step equals Muon's definition, computed here in float64 ---------------------------------

A, B, C = 3.4445, -4.7750, 2.0315  # Keller Jordan's quintic Newton-Schulz coefficients
POLAR_EXPRESS = [  # arXiv:2505.16932's five steps (safety 2e-2, cushion 2), input scaled by 1.02 x its norm
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def newton_schulz(g: torch.Tensor, steps: int, coefficients: str = "quintic") -> torch.Tensor:
    tall = g.shape[0] > g.shape[1]
    x = g.T if tall else g
    safety = 1.02 if coefficients == "polar_express" else 1.0
    x = x / max(x.norm().item() * safety, 1e-7)
    for i in range(steps):
        a, b, c = (A, B, C) if coefficients == "quintic" else POLAR_EXPRESS[min(i, 4)]
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def normuon(o: torch.Tensor, moment: torch.Tensor, beta2: float) -> torch.Tensor:
    """NorMuon on one (out, in) orthogonalised matrix: each row (output neuron) divided by the root of its
    running mean square (`moment`, updated in place), then the whole scaled back to its Frobenius norm."""
    moment.mul_(beta2).add_((1 - beta2) * (o * o).mean(dim=1))
    n = o / (moment.sqrt() + 1e-10)[:, None]
    return n * (o.norm() / n.norm())


def reference_muon(
    name: str, p, grad, buf, *, lr, wd, momentum, steps, scale, muon_lr, conv1d, coefficients="quintic",
    moments=None, beta2=None, interleaved=False,
):  # fmt: skip
    """Keller Jordan's form: B = mu B + g, Nesterov update g + mu B (torch's lerp form differs by the factor
    1 - mu, which the normalisation removes). Matrices are (out, in) but GPT-2's Conv1D and GPT-OSS's
    experts are (in, out) (`conv1d`). An expert's gate_up_proj is its gate and up projections: halves,
    alternate outputs in GPT-OSS (`interleaved`). `moments`: NorMuon's per-neuron state of each matrix."""
    buf.mul_(momentum).add_(grad)
    u = grad + momentum * buf
    mats = list(u) if u.dim() == 3 else [u]  # an expert stack: one matrix per expert
    outs = []
    for e, m in enumerate(mats):
        m = m.T if conv1d else m
        pieces = 3 if name.endswith("c_attn.weight") else 2 if name.endswith("gate_up_proj") else 1
        rows_of = [torch.arange(m.shape[0]).chunk(pieces)[i] for i in range(pieces)]  # Q, K, V side by side
        if interleaved:
            rows_of = [torch.arange(i, m.shape[0], pieces) for i in range(pieces)]  # gate, up, gate, up, ...
        parts = [newton_schulz(m[rows], steps, coefficients) for rows in rows_of]
        if moments is not None:
            state = moments.setdefault(e, torch.zeros(m.shape[0], dtype=m.dtype))
            for i, rows in enumerate(rows_of):
                s = state[rows]
                parts[i] = normuon(parts[i], s, beta2)
                state[rows] = s
        rows, cols = parts[0].shape
        factor = 0.2 * math.sqrt(max(rows, cols)) * lr if scale == "match_rms_adamw" else None
        if scale == "original":
            factor = muon_lr * (lr / 0.01) * math.sqrt(max(1, rows / cols))  # the schedule's factor
        o = torch.empty_like(m)
        for rows, part in zip(rows_of, parts, strict=True):
            o[rows] = part * factor
        outs.append(o.T if conv1d else o)
    base_lr = lr if scale == "match_rms_adamw" else muon_lr * (lr / 0.01)
    p.mul_(1 - base_lr * wd).sub_(torch.stack(outs) if u.dim() == 3 else outs[0])


@pytest.mark.parametrize(
    "model_type,scale,name,coefficients",
    [("llama", "match_rms_adamw", "muon", "quintic"), ("llama", "original", "muon", "quintic"),
     ("gpt2", "match_rms_adamw", "muon", "quintic"), ("mixtral", "match_rms_adamw", "muon", "quintic"),
     ("gpt_oss", "original", "muon", "quintic"), ("llama", "match_rms_adamw", "muon", "polar_express"),
     ("llama", "match_rms_adamw", "normuon", "quintic"), ("gpt2", "original", "normuon", "polar_express"),
     ("mixtral", "match_rms_adamw", "normuon", "quintic"), ("gpt_oss", "original", "normuon", "quintic")],
)  # fmt: skip
def test_muon_steps_equal_a_float64_reference(model_type, scale, name, coefficients):
    model = tiny(model_type)
    steps = 6 if coefficients == "polar_express" else 4  # past the fifth step too
    cfg = muon_cfg(
        name=name, muon_lr_scale=scale, muon_lr=0.03, muon_momentum=0.9, muon_ns_steps=steps,
        muon_coefficients=coefficients, normuon_beta2=0.8,
    )  # fmt: skip
    opt = build_optimizer(model, cfg)
    ref = copy.deepcopy(model)
    ref_params = dict(ref.named_parameters())
    muon = names_in(opt, model, "muon")
    # The AdamW part is torch's AdamW over the same groups (the AdamW path is tested elsewhere).
    others = [{**g, "params": [ref_params[n] for n in names_in_group(g, model)]} for g in opt.param_groups]
    ref_adamw = torch.optim.AdamW([g for g in others if g["kind"] == "adamw"], lr=0.01, betas=(0.9, 0.95))
    bufs = {n: torch.zeros_like(ref_params[n]) for n in muon}
    moments = {n: {} if name == "normuon" else None for n in muon}
    torch.manual_seed(1)
    for lr in (0.004, 0.01, 0.007):  # the schedule changes the lr every step
        ids = torch.randint(0, VOCAB, (2, 10))
        for m in (model, ref):
            m(input_ids=ids, labels=ids).loss.backward()
        set_lr(opt, lr)
        opt.step()
        set_lr(ref_adamw, lr)
        with torch.no_grad():
            for n in muon:
                p = ref_params[n]
                in_out = "transformer.h" in n or (model_type == "gpt_oss" and ".experts." in n)
                reference_muon(n, p, p.grad, bufs[n], lr=lr, wd=0.1, momentum=0.9, steps=steps, scale=scale,
                               muon_lr=0.03, conv1d=in_out, coefficients=coefficients, moments=moments[n],
                               beta2=0.8, interleaved=model_type == "gpt_oss")  # fmt: skip
        ref_adamw.step()
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        for n, p in model.named_parameters():
            diff = (p - ref_params[n]).norm() / (ref_params[n] - 0).norm()
            assert diff < 1e-6, (n, diff.item())
    moved = [
        n
        for n in muon
        if not torch.equal(dict(model.named_parameters())[n], tiny(model_type).get_parameter(n))
    ]
    assert sorted(moved) == sorted(muon)


def names_in_group(group: dict, model) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for p in group["params"]]


def test_state_dict_round_trip_keeps_momentum_and_relinks_adamw():
    model = tiny("llama")
    opt = build_optimizer(model, muon_cfg())
    ids = torch.randint(0, VOCAB, (2, 10))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    fresh = build_optimizer(model, muon_cfg())
    fresh.load_state_dict(saved)
    assert isinstance(fresh, MuonAdamW)
    assert fresh._adamw.state is fresh.state and all(
        any(g is h for h in fresh.param_groups) for g in fresh._adamw.param_groups
    )
    kinds = {k for s in fresh.state.values() for k in s}
    assert kinds == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}
    # a resume with other settings takes the config's
    apply_hyperparameters(fresh, muon_cfg(muon_momentum=0.8, muon_ns_steps=3, weight_decay=0.05))
    muon_group = next(g for g in fresh.param_groups if g["kind"] == "muon")
    assert (muon_group["momentum"], muon_group["ns_steps"], muon_group["weight_decay"]) == (0.8, 3, 0.05)
    assert "betas" not in muon_group


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])  # per-row and (Conv1D) per-column neurons
def test_normuon_state_round_trips_and_the_resumed_steps_are_bit_identical(model_type):
    ids = [torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    cfg = muon_cfg(name="normuon", muon_coefficients="polar_express")

    def step(model, opt, batch):
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    straight = tiny(model_type)
    opt = build_optimizer(straight, cfg)
    step(straight, opt, ids[0])
    saved = copy.deepcopy((straight.state_dict(), opt.state_dict()))
    moments = [s["second_moment"] for s in opt.state.values() if "second_moment" in s]
    assert len(moments) == len([p for g in opt.param_groups if g["kind"] == "muon" for p in g["params"]])
    assert all(m.abs().sum() > 0 for m in moments)
    shapes = {tuple(m.shape) for m in moments}
    assert shapes == ({(1, 96), (1, 128), (1, 32)} if model_type == "gpt2" else {(32, 1), (16, 1), (48, 1)})
    for batch in ids[1:]:
        step(straight, opt, batch)
    resumed = tiny(model_type, seed=5)  # other weights: everything comes from the state dicts
    resumed.load_state_dict(saved[0])
    opt2 = build_optimizer(resumed, cfg)
    opt2.load_state_dict(saved[1])
    for batch in ids[1:]:
        step(resumed, opt2, batch)
    for (n, p), q in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_a_resume_that_switches_muon_and_normuon_says_so_and_keeps_the_momentum(tmp_path):
    """Muon -> NorMuon: the momentum comes back and the second moments, which a Muon checkpoint lacks, start
    at zero (a sharded checkpoint: DCP must not ask for them); NorMuon -> Muon drops them. One line each."""
    from types import SimpleNamespace

    from lmpretrain.checkpoint.formats import ShardedFiles
    from lmpretrain.update.schedule import hyperparameter_changes

    for old, new, note in (
        ("muon", "normuon", "(momentum kept; NorMuon's per-neuron second moments, absent from a Muon "
         "checkpoint, start at zero as in a fresh run)"),
        ("normuon", "muon", "(momentum kept; the checkpoint's NorMuon second moments are dropped)"),
    ):  # fmt: skip
        saved, now = (load_config([str(rr.SMOKE), f"--optim.name={n}"]) for n in (old, new))
        line = hyperparameter_changes(saved.to_dict(), now, step=4, updates=4)
        assert line.startswith(
            f"resumed with new hyper-parameters from step 4: optim.name {old} -> {new} {note} (lr"
        )
        assert "\n" not in line
    ids = [torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(s)) for s in range(3)]

    def step(model, opt, batch):
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def moments(opt):
        return [s["second_moment"] for s in opt.state.values() if "second_moment" in s]

    muon = tiny("llama")
    opt = build_optimizer(muon, muon_cfg())
    step(muon, opt, ids[0])
    files = ShardedFiles(SimpleNamespace(num_processes=1, is_main_process=True))
    error, write = files.write(muon, opt, tmp_path, None)
    assert error is None
    write.result()
    switched = tiny("llama", seed=5)
    opt2 = build_optimizer(switched, muon_cfg(name="normuon"))
    files.load(tmp_path, {}, switched, opt2)  # DCP reads Muon's state into NorMuon's layout
    apply_hyperparameters(opt2, muon_cfg(name="normuon"))
    assert moments(opt2) == [] and all(g["normuon"] for g in opt2.param_groups if g["kind"] == "muon")
    ref = copy.deepcopy(muon)  # the same state through torch's own load (in memory)
    opt3 = build_optimizer(ref, muon_cfg(name="normuon"))
    opt3.load_state_dict(opt.state_dict())
    apply_hyperparameters(opt3, muon_cfg(name="normuon"))
    for batch in ids[1:]:
        for model, o in ((switched, opt2), (ref, opt3)):
            step(model, o, batch)
    for (n, p), q in zip(switched.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert len(moments(opt2)) == 14 and all(m.abs().sum() > 0 for m in moments(opt2))
    # NorMuon -> Muon (a full checkpoint is torch's state dict): the second moments go, Muon steps on
    back = build_optimizer(switched, muon_cfg())
    back.load_state_dict(opt2.state_dict())
    apply_hyperparameters(back, muon_cfg())
    assert moments(back) == [] and "second_moment" not in str(back.state_dict()["state"])
    step(switched, back, ids[0])
    assert all("momentum_buffer" in s for s in back.state.values() if "exp_avg" not in s)


# ---- Config checks --------------------------------------------------------------------------------


def test_bad_muon_settings_are_one_clear_problem():
    cfg = load_config([str(rr.SMOKE), "--optim.name=muon", "--optim.muon_momentum=1.0"])
    assert [p for p in config_problems(cfg, 1) if "muon" in p] == [
        "optim.muon_momentum=1.0 must be in [0, 1), optim.muon_ns_steps=5 >= 1 and optim.muon_lr=0.02 > 0"
    ]
    cfg = load_config([str(rr.SMOKE), "--optim.name=normuon", "--optim.normuon_beta2=1.0"])
    assert [p for p in config_problems(cfg, 1) if "muon" in p] == [
        "optim.normuon_beta2=1.0 must be in [0, 1)"
    ]
    with pytest.raises(ConfigError) as err:  # allowed values are checked as the config loads
        load_config([str(rr.SMOKE), "--optim.name=lion", "--optim.muon_lr_scale=rms"])
    assert err.value.problems == [
        "optim.name='lion' must be one of adamw, muon, normuon",
        "optim.muon_lr_scale='rms' must be one of match_rms_adamw, original",
    ]


def test_deepspeed_and_fsdp1_are_refused_ddp_and_fsdp2_are_not():
    cfg = dataclasses.replace(OptimConfig(), name="muon")
    zero2 = Layout("deepspeed", 2, zero_stage=2)
    (problem,) = muon_problems(cfg, zero2)
    assert problem.startswith("optim.name=muon cannot run under deepspeed-zero2: it flattens the parameters")
    assert muon_problems(cfg, Layout("fsdp1", 2))
    for ok in (Layout(), Layout("ddp", 2), Layout("fsdp2", 2), Layout("fsdp2", 4, replicas=2)):
        assert muon_problems(cfg, ok) == []
    assert muon_problems(OptimConfig(), zero2) == []  # AdamW runs there


def test_a_model_without_blocks_is_refused():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10))
    with pytest.raises(ConfigError, match="found no transformer blocks in Sequential"):
        build_optimizer(model, muon_cfg())


# ---- The recipe on real processes (slow) ----------------------------------------------------------

# NorMuon: Muon's every step (momentum, routing, spreading) plus its second moments, so these runs cover
# both, and the kill -9 resume under FSDP2 is the "done when" (configs/smoke.yaml-like, normuon).
MUON = [*rr.EXACT, "--optim.name=normuon", "--train.micro_batch_size=2", "--train.grad_accum_steps=2"]
FSDP_RUN = [*MUON, "--checkpoint.every=4", "--checkpoint.keep_last=3"]
TIMEOUT = 1200  # generous: a loaded 2-core machine runs these at a fraction of its speed


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return rr.run(tmp_path_factory.mktemp("muon-ddp") / "run", *FSDP_RUN, launch="cpu-ddp", timeout=TIMEOUT)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return rr.run(tmp_path_factory.mktemp("muon-fsdp") / "run", *FSDP_RUN, launch="cpu-fsdp", timeout=TIMEOUT)


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["cpu-ddp", "cpu-fsdp"])
def test_the_plan_says_what_the_muon_run_sent_and_held(launch, request):
    """The planner against step 2 of the real Muon runs on rank 0 (tests/plan_check.py): bytes held
    exactly, each collective kind within 2%, Muon's own line (its step's collectives) included."""
    figures, off = plan_check.compare(
        request.getfixturevalue("ddp" if launch == "cpu-ddp" else "fsdp"), launch
    )
    assert figures["muon"][1] > 0 or launch == "cpu-ddp", figures
    assert off == [], figures


@pytest.mark.slow
def test_fsdp2_trains_like_ddp_in_float64(fsdp, ddp):
    assert "sharding=fsdp2" in fsdp.output and "NorMuon: 14 matrices" in fsdp.output
    # optim.muon_spread=auto spreads both here (so the resume tests below run spread too)
    assert "spread over 2 ranks under FSDP2 (auto: it moves fewer bytes" in fsdp.output
    assert "spread over 2 ranks (optim.muon_spread=auto: Newton-Schulz" in ddp.output
    rr.assert_close_runs(fsdp, ddp, rel=1e-6)


@pytest.mark.slow
def test_hsdp_on_four_ranks_trains_like_fsdp2_and_a_mesh_of_another_size_is_refused(fsdp, tmp_path):
    """configs/accelerate/cpu-hsdp.yaml: 2 replica groups x 2 shards, the same global batch as the 2-rank
    FSDP2 run (4 ranks x 1 row x 2 micro-batches), NorMuon spread in each shard group and over the replicas."""
    hsdp = rr.run(
        tmp_path / "hsdp", *FSDP_RUN, "--train.micro_batch_size=1", launch="cpu-hsdp", timeout=TIMEOUT
    )
    assert "sharding=fsdp2 HSDP: 2 replica groups x 2 shards (parallelism_config)" in hsdp.output
    # the recipe's Layout (read from its Accelerator) is the one the planner and the pre-flight plan this launch by
    planned = read_launch(str(plan_check.ACCELERATE / "cpu-hsdp.yaml"), None, None)
    assert (
        "world_size=4 " in hsdp.output and f"sharding={planned.describe()} (accelerate's FSDP2" in hsdp.output
    )
    assert "and over the 2 replica groups (optim.muon_spread=auto" in hsdp.output
    rr.assert_close_runs(hsdp, fsdp, rel=1e-6)
    figures, off = plan_check.compare(hsdp, "cpu-hsdp", world=4)  # the planner's HSDP step, as rank 0 ran it
    assert figures["all_reduce"][1] > figures["params"][1] and figures["muon"][1] > 0, figures
    assert off == [], figures
    bad = rr.run(
        tmp_path / "bad", *FSDP_RUN, launch="cpu-hsdp", launch_args=["--num_processes", "3"], check=False
    )
    assert bad.returncode != 0 and not (tmp_path / "bad").exists()
    assert (
        "error: the launch config's parallelism_config asks for 2 replica groups x 2 shards = 4 processes, "
        "but 3 were launched: make parallelism_config_dp_replicate_size x parallelism_config_dp_shard_size "
        "equal num_processes"
    ) in bad.output


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["cpu-fsdp", "cpu-ddp"])
def test_kill_9_then_resume_is_bit_identical(launch, request, tmp_path):
    """Full checkpoints under DDP, sharded (DCP) under FSDP2: momentum buffers and NorMuon's second
    moments (row-sharded DTensors under FSDP2) come back exactly."""
    straight = request.getfixturevalue("ddp" if launch == "cpu-ddp" else "fsdp")
    _, resumed = rr.killed_then_resumed(tmp_path / "killed", FSDP_RUN, launch, TIMEOUT)
    rr.assert_bit_identical(straight, resumed)
    fmt = "full" if launch == "cpu-ddp" else "sharded"
    assert f"checkpoints: format={fmt}" in resumed.output


@pytest.mark.slow
def test_a_sharded_muon_checkpoint_resumes_on_one_process(fsdp, tmp_path):
    out = tmp_path / "one"
    shutil.copytree(fsdp.out, out)
    shutil.rmtree(out / "final")
    for ckpt in (out / "checkpoints").glob("step-*"):
        if ckpt.name != "step-00000004":
            shutil.rmtree(ckpt)
    one = rr.run(
        out,
        *FSDP_RUN,
        "--train.micro_batch_size=4",
        launch="cpu",
        timeout=TIMEOUT,
    )
    assert "world_size=1" in one.output and "at step 4" in one.output
    ref = fsdp.losses()
    assert [one.losses()[s] for s in range(5, 11)] == pytest.approx([ref[s] for s in range(5, 11)], rel=1e-6)
    assert rr.rel_diff(one.weights(), fsdp.weights()) < 1e-6


@pytest.mark.slow
def test_two_ddp_ranks_train_like_one_process(ddp, tmp_path):
    one = rr.run(tmp_path / "one", *FSDP_RUN, "--train.micro_batch_size=4", launch="cpu", timeout=TIMEOUT)
    assert "NorMuon: 14 matrices in 14 tensors" in one.output
    rr.assert_close_runs(ddp, one, rel=1e-6)
    first, last = ddp.losses()[1], ddp.losses()[10]
    assert last < first - 0.3  # it learns


def test_fp16_overflow_skips_the_muon_update_and_momentum():
    """The fp16 GradScaler unscales every group, and on an inf skips the whole step: no weight, momentum or
    AdamW moment changes; the next finite step goes through."""
    from lmpretrain.model.precision import MixedPrecision

    model = tiny("llama").float()
    opt = build_optimizer(model, muon_cfg())
    precision = MixedPrecision("fp16", torch.device("cpu"), init_scale=1024.0)
    ids = torch.randint(0, VOCAB, (2, 10))
    stepped = []
    for poisoned in (False, True, False):
        with precision.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        precision.scale(loss.float()).backward()
        if poisoned:
            model.model.layers[0].self_attn.q_proj.weight.grad[0, 0] = float("inf")
        before = copy.deepcopy((dict(model.named_parameters()), opt.state_dict()["state"]))
        precision.unscale_(opt)
        stepped.append(precision.step(opt))
        opt.zero_grad(set_to_none=True)
        after = (dict(model.named_parameters()), opt.state_dict()["state"])
        same = all(torch.equal(before[0][n], p) for n, p in after[0].items()) and all(
            torch.equal(before[1][i][k], v) for i, s in after[1].items() for k, v in s.items()
        )
        assert same == poisoned
    assert stepped == [True, False, True] and precision.loss_scale == 512.0
