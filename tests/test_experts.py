"""model.experts_implementation: each of transformers' experts implementations equals the eager loop
(forward and gradients) for three mixtures of experts, the start-up line says which kernel really ran
(seen on a probe, under autocast too), and what cannot run is refused before any work."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lmpretrain.config import load_config
from lmpretrain.errors import ConfigError
from lmpretrain.model.build import build_model, build_model_config, causal_lm_class
from lmpretrain.model.experts import describe_experts, experts_problems
from lmpretrain.model.speed import kernel_problems

VOCAB = 64
SHAPE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
TINY = {  # 4 experts, 2 per token
    "qwen3_moe": {**SHAPE, "intermediate_size": 48, "moe_intermediate_size": 16, "num_experts": 4},
    "mixtral": {**SHAPE, "intermediate_size": 24, "num_local_experts": 4},
    "olmoe": {**SHAPE, "intermediate_size": 24, "num_experts": 4},
}


def tiny(model_type: str, experts: str, dtype=torch.float64, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type, vocab_size=VOCAB, num_experts_per_tok=2, **{**TINY[model_type], **extra}
    )
    config._attn_implementation = "eager"
    # initialised in float64 and then rounded: the same weights in either dtype
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, experts_implementation=experts)
    return model.to(dtype)


def forward_backward(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("model_type", list(TINY))
def test_each_implementation_equals_the_eager_loop_forward_and_gradients(model_type):
    logits, grads = forward_backward(tiny(model_type, "eager"))
    experts = {n for n in grads if ".experts." in n}
    assert experts and all(grads[n].abs().sum() > 0 for n in experts)  # every expert was routed to
    # batched_mm in float64: the same sums in another order
    b_logits, b_grads = forward_backward(tiny(model_type, "batched_mm"))
    assert rel(b_logits, logits) < 1e-12
    assert max(rel(b_grads[n], grads[n]) for n in grads) < 1e-12
    # grouped_mm: torch's kernel takes no float64, so float32, against the float64 loop: float32's rounding
    for impl in ("grouped_mm", "eager"):
        f_logits, f_grads = forward_backward(tiny(model_type, impl, torch.float32))
        assert rel(f_logits, logits) < 1e-5, impl
        assert max(rel(f_grads[n], grads[n]) for n in grads) < 1e-4, impl


def test_the_start_up_line_names_the_kernel_that_ran_and_its_dtype():
    lines = {
        impl: describe_experts(tiny("qwen3_moe", impl, torch.float32)) for impl in ("eager", "batched_mm")
    }
    lines["grouped_mm"] = describe_experts(tiny("qwen3_moe", "grouped_mm", torch.float32))
    modules = "in 2 Qwen3MoeExperts modules of 4 experts"
    assert (
        lines["eager"] == f"experts: eager (two matmuls per expert hit, float32; seen in a probe) {modules}"
    )
    assert lines["batched_mm"] == (
        f"experts: batched_mm (one batched matmul per projection, float32; seen in a probe) {modules}"
    )
    assert (
        lines["grouped_mm"]
        == f"experts: grouped_mm (torch's grouped matmul, float32; seen in a probe) {modules}"
    )
    # under bf16 autocast the batched matmul computes in bf16; torch's grouped matmul has no autocast rule
    batched = describe_experts(tiny("mixtral", "batched_mm", torch.float32), "bf16")
    assert "batched matmul per projection, bfloat16;" in batched and "not in" not in batched
    grouped = describe_experts(tiny("mixtral", "grouped_mm", torch.float32), "bf16")
    assert grouped.startswith("experts: grouped_mm (torch's grouped matmul, float32; seen in a probe)")
    assert grouped.endswith(
        "; not in train.precision=bf16's dtype: torch's grouped matmul has no autocast rule"
    )
    assert describe_experts(torch.nn.Linear(2, 2)) is None  # no experts, no line


def test_the_probe_leaves_weights_and_gradients_as_they_were():
    model = tiny("olmoe", "batched_mm")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    describe_experts(model)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_auto_builds_grouped_mm_or_batched_mm_in_float64_and_the_setting_reaches_transformers():
    cfg = load_config(["configs/smoke.yaml", "--model.type=qwen3_moe", "--model.overrides.num_experts=4"])
    for dtype, chosen in (("float32", "grouped_mm"), ("float64", "batched_mm")):
        # (a new config each time: transformers writes the implementation it built with onto it)
        assert (
            build_model(build_model_config(cfg.model), dtype=dtype).config._experts_implementation == chosen
        )
    cfg = load_config(["configs/smoke.yaml", "--model.type=mixtral", "--model.experts_implementation=eager"])
    model = build_model(build_model_config(cfg.model), dtype="float32")
    assert model.config._experts_implementation == "eager" and "eager (two matmuls" in describe_experts(model)
    assert "_experts_implementation" not in model.config.to_dict()  # not saved with the model, as attention


def test_what_cannot_run_is_refused_before_any_work():
    def problems(*args):
        cfg = load_config(["configs/smoke.yaml", *args])
        return kernel_problems(cfg, build_model_config(cfg.model))

    assert problems("--model.experts_implementation=grouped_mm") == [
        "model.experts_implementation=grouped_mm: LlamaForCausalLM has no mixture of experts; leave it at auto"
    ]
    assert problems(
        "--model.type=mixtral", "--model.experts_implementation=grouped_mm", "--train.param_dtype=float64"
    ) == [
        "model.experts_implementation=grouped_mm: torch's grouped matmul has no float64 kernel "
        "(train.param_dtype=float64); use batched_mm or eager, or auto"
    ]
    cfg = load_config(
        ["configs/smoke.yaml", "--model.type=mixtral", "--model.experts_implementation=batched_mm"]
    )
    config = build_model_config(cfg.model)
    assert experts_problems(cfg, config, causal_lm_class(config)) == []
    # Qwen3-MoE's default is 8 experts per token: with 4 experts torch's top-k fails in the first forward
    assert problems("--model.type=qwen3_moe", "--model.overrides.num_experts=4") == [
        "model.overrides.num_experts_per_tok=8 is more than the model's 4 experts per layer (a token picks that "
        "many): lower it or raise the experts"
    ]
    # a width torch's CPU grouped matmul cannot take (strides not a multiple of 16 bytes): stopped at start-up
    odd = tiny("qwen3_moe", "grouped_mm", torch.float32, hidden_size=30, num_attention_heads=2)
    with pytest.raises(
        ConfigError, match=r"grouped_mm cannot run Qwen3MoeExperts here \(.*16 bytes.*batched_mm"
    ):
        describe_experts(odd)
