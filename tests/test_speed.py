"""The speed switches end to end: each one, and all together, trains like the plain recipe (losses, grad
norms, final weights); what runs is printed; a kill -9 with everything on (plus document masking and
z-loss) resumes bit-identically, and 2 ranks with accumulation equal 1 rank; fused and foreach AdamW
checkpoints load into each other; kernels that cannot run here are refused before any work."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import one_layer_llama_config
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from transformers import AutoModelForCausalLM

import recipe_runner as rr
from lmpretrain.config import OptimConfig
from lmpretrain.update.optim import build_optimizer

pytestmark = pytest.mark.slow  # end-to-end: launches the recipe in subprocesses

# float64 so that a real difference is not hidden by fp32 summation noise (which Adam amplifies to
# ~1e-5 in 10 steps); one thread so a busy machine does not stall the ranks' OpenMP barriers.
EXACT = [
    *rr.QUICK,
    "--train.max_steps=12",
    "--eval.every=0",
    "--checkpoint.every=0",
    "--eval.batches=1",
    "--eval.batch_size=4",
    "--train.param_dtype=float64",
    "--logging.wandb_mode=disabled",
    "--run.threads=1",
    "--model.overrides.hidden_size=32",
    "--model.overrides.intermediate_size=64",
]
OFF = [
    "--train.compile=false",
    "--train.activation_checkpointing=none",
    "--train.loss_impl=full",
    "--optim.fused=false",
    "--model.attn_implementation=eager",
]
SWITCHES = {
    "compile": "--train.compile=true",
    "activation_checkpointing": "--train.activation_checkpointing=full",
    "selective_checkpointing": "--train.activation_checkpointing=selective",
    "chunked_loss": "--train.loss_impl=chunked",
    "fused_adamw": "--optim.fused=true",
    "sdpa": "--model.attn_implementation=sdpa",
}
# selective checkpointing under compile (full is compiled in tests/test_fsdp.py); a chunk that does not
# divide the rows
ALL_ON = [
    *(f for n, f in SWITCHES.items() if n != "activation_checkpointing"),
    "--train.loss_chunk_tokens=96",
]
# Relative tolerances. Checkpointing recomputes the same ops: bit-identical. The chunked loss and fused
# AdamW only change summation order: float64 noise. Compiled kernels and sdpa differ where Llama computes
# in float32 even with float64 weights (RMSNorm, rotary embeddings, eager attention's softmax): fp32
# noise, amplified by Adam to ~2e-7 over 12 steps here.
TOLERANCE = {
    "activation_checkpointing": 0.0,
    "selective_checkpointing": 0.0,
    "chunked_loss": 1e-12,
    "fused_adamw": 1e-12,
    "compile": 1e-5,
    "sdpa": 1e-5,
    "all": 1e-5,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The plain recipe, each switch alone, and all together: two runs at a time (each uses one thread)."""
    out = tmp_path_factory.mktemp("speed")
    plan = {"off": OFF, **{name: [*OFF, flag] for name, flag in SWITCHES.items()}}
    plan["all"] = [*OFF, *ALL_ON, "--eval.sample_tokens=8"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(rr.run, out / name, *EXACT, *args, launch=None) for name, args in plan.items()
        }
    return {name: future.result() for name, future in futures.items()}


def assert_trains_alike(run, ref, tolerance):
    a, b = run.metrics(), ref.metrics()
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 13))
    for x, y in zip(a, b, strict=True):
        for key in ("train/loss", "train/grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=tolerance, abs=0), (key, x["step"])
    assert a[-1]["eval/loss"] == pytest.approx(b[-1]["eval/loss"], rel=tolerance, abs=0)
    assert rr.rel_diff(run.weights(), ref.weights()) <= tolerance


@pytest.mark.parametrize("switch", [*SWITCHES, "all"])
def test_each_switch_and_all_together_train_like_the_plain_recipe(runs, switch):
    assert_trains_alike(runs[switch], runs["off"], TOLERANCE[switch])


def test_what_really_runs_is_printed(runs):
    assert "[lmpretrain] attention: eager" in runs["off"].output
    assert "AdamW implementation: foreach (optim.fused=false)" in runs["off"].output
    assert "loss: full (logits of the whole micro-batch" in runs["off"].output
    assert "[lmpretrain] activation checkpointing: none (every activation kept" in runs["off"].output
    assert (
        "activation checkpointing: full, 2 blocks (only each block's input kept"
        in runs["activation_checkpointing"].output
    )
    everything = runs["all"].output
    for line in (
        "[lmpretrain] attention: sdpa",
        "[lmpretrain] loss: chunked (96 tokens of logits at a time, from the final hidden states); "
        "document masking: off",
        "[lmpretrain] chunked loss: logits = output embedding(final hidden states) for llama, checked",
        "[lmpretrain] activation checkpointing: selective, 2 blocks (matmul and attention outputs kept, the "
        "ops between them recomputed), non-reentrant, RNG preserved",
        "[lmpretrain] compile: 2 LlamaDecoderLayer blocks (torch.compile, inductor; compiled on first use)",
        "AdamW implementation: fused",
    ):
        assert line in everything
    assert "[lmpretrain] sample: " in everything  # generation runs (eager) next to the compiled blocks
    assert "recompile_limit" not in everything


def test_compile_time_is_logged_once(runs):
    for name in ("compile", "all"):
        logged = [r["perf/compile_s"] for r in runs[name].metrics() if "perf/compile_s" in r]
        assert len(logged) == 1 and logged[0] > 0 and "perf/compile_s" in runs[name].metrics()[0]
    assert not any("perf/compile_s" in r for r in runs["off"].metrics())


# ---- all switches + document masking + z-loss: resume and data parallelism --------------------------

MASKED = [
    *EXACT,
    *ALL_ON,
    "--data.document_masking=true",
    "--train.z_loss=1e-3",
    "--train.micro_batch_size=2",
]
MASKED_1RANK = [*MASKED, "--train.grad_accum_steps=4", "--checkpoint.every=4"]


@pytest.fixture(scope="module")
def masked_straight(tmp_path_factory):
    """1 rank x micro-batch 2 x accumulation 4, everything on."""
    return rr.run(tmp_path_factory.mktemp("masked") / "run", *MASKED_1RANK, launch=None)


def test_document_masking_and_z_loss_are_on_and_logged(masked_straight):
    assert (
        "document masking: on (positions restart after each EOS; block-causal mask)" in masked_straight.output
    )
    assert "packed documents = documents alone for llama with sdpa" in masked_straight.output
    # train/z_loss is the term's own (unweighted) mean of logsumexp(logits)^2 over the targets: at
    # initialisation the logits are near 0, so logsumexp is near log(vocab) = log(8192) ~ 9.
    z = [r["train/z_loss"] for r in masked_straight.metrics() if "train/z_loss" in r]
    assert len(z) == 12 and all(1 < v < 200 for v in z), z


def test_kill_9_with_every_switch_on_resumes_bit_identically(masked_straight, tmp_path):
    out = tmp_path / "run"
    proc = rr.start_forked(out, *MASKED_1RANK, launch=None)
    rr.wait_for_step(proc, out, 6)
    rr.kill_tree(proc)
    proc.wait(timeout=60)
    assert rr.read_metrics(out)[-1]["step"] < 12, "the run finished before it could be killed"
    resumed = rr.run(out, *MASKED_1RANK, launch=None)
    assert "resumed from" in resumed.output
    assert rr.file_sha256(out / "final" / "model.safetensors") == rr.file_sha256(
        masked_straight.out / "final" / "model.safetensors"
    )
    keys = ("train/loss", "train/grad_norm", "train/z_loss", "eval/loss")
    straight = {r["step"]: [r.get(k) for k in keys] for r in masked_straight.metrics()}
    assert {r["step"]: [r.get(k) for k in keys] for r in resumed.metrics()} == straight


def test_two_ranks_with_accumulation_equal_one_rank_with_masking_and_z_loss(masked_straight, tmp_path):
    two = rr.run(tmp_path / "ddp", *MASKED, "--train.grad_accum_steps=2", launch="cpu-ddp")
    assert "world_size=2" in two.output
    for a, b in zip(two.metrics(), masked_straight.metrics(), strict=True):
        for key in ("train/loss", "train/grad_norm", "train/z_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-9, abs=0), (key, a["step"])
    assert rr.rel_diff(two.weights(), masked_straight.weights()) < 1e-9


# ---- fused <-> foreach AdamW checkpoints, and refusals -------------------------------------------


def test_fused_and_foreach_adamw_checkpoints_load_into_each_other():
    """Through torch.distributed.checkpoint's full state dicts (what checkpoints hold): the loaded
    optimizer keeps its own implementation and continues the same trajectory."""
    torch.set_num_threads(1)
    config = one_layer_llama_config(40)
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))

    def trained(fused: bool, steps: int, state=None):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
        optimizer = build_optimizer(model, OptimConfig(lr=1e-2, fused=fused))
        if state is not None:
            model.load_state_dict(state[0])
            set_optimizer_state_dict(
                model, optimizer, state[1], options=StateDictOptions(full_state_dict=True)
            )
        for _ in range(steps):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        saved = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
        return model, optimizer, (model.state_dict(), saved)

    straight, _, _ = trained(True, 6)
    for first, then in ((True, False), (False, True)):
        _, _, state = trained(first, 3)
        model, optimizer, _ = trained(then, 3, state)
        assert [(g["fused"], g["foreach"]) for g in optimizer.param_groups] == [(then, not then)] * 2
        for p, q in zip(model.parameters(), straight.parameters(), strict=True):
            assert torch.allclose(p, q, rtol=1e-12, atol=0)


def test_a_kernel_that_cannot_run_here_is_refused_before_any_work(tmp_path):
    run = rr.run(tmp_path / "fa2", "--model.attn_implementation=flash_attention_2", check=False, launch=None)
    assert run.returncode == 2
    assert (
        "model.attn_implementation=flash_attention_2 needs a CUDA GPU and `pip install flash-attn`"
        in run.output
    )
    assert "Traceback" not in run.output and not (tmp_path / "fa2" / "metrics.jsonl").exists()


def test_gpu_check_script_passes_its_cpu_dry_run(tmp_path):
    proc = subprocess.run(
        ["bash", str(rr.ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(tmp_path)],
        cwd=rr.ROOT,
        env=rr.env_for_runs({"PYTHON": sys.executable}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "gpu_check: 12 commands have valid configs" in proc.stdout
    assert "gpu_check: dry run passed" in proc.stdout
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    eager = result["rows"]["eager"]
    assert result["dry_run"] and eager["status"] == "ok" and eager["steps"] == 3 and eager["tokens_per_s"] > 0
    lines = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("gpu_check: ")]
    header = lines.index("row")
    assert lines[header + 1 : header + 12] == [
        *("eager", "compile", "liger", "fp8", "fsdp2-1gpu"),
        *("syncs", "parity", "resume", "fp16", "flash-varlen", "experts"),
    ]  # the table's rows, in order


def test_the_benchmark_lean_reference_has_the_recipe_models_size(stdlib_cache):
    """scripts/benchmark.py's lean reference trains on the recipe's batches a model of the same shape
    (same parameter count), so recipe / lean compares like with like."""
    from lmpretrain.config import load_config
    from lmpretrain.model.build import build_model, build_model_config, parameter_counts

    proc = subprocess.run(
        [sys.executable, "scripts/benchmark.py", "configs/smoke.yaml", "--lean", "--steps=2", "--warmup=1"],
        cwd=rr.ROOT,
        env=rr.env_for_runs(None),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lean = json.loads(proc.stdout.splitlines()[-1])
    cfg = load_config([str(rr.ROOT / "configs" / "smoke.yaml")])
    with torch.device("meta"):
        model = build_model(build_model_config(cfg.model))
    assert lean["params"] == parameter_counts(model)["params_total"]
    assert lean["tokens_per_s"] > 0 and lean["peak_rss_bytes"] > 0


@pytest.mark.parametrize("activation", ["gelu_new", "gelu_fast"])
def test_python_tanh_gelu_runs_as_one_kernel_with_the_same_values(activation):
    """GPT-2's gelu_new (and gelu_fast) become torch's gelu(approximate='tanh'): same forward and
    gradients to float rounding, parameter names and config unchanged, and the log line says so."""
    from transformers import AutoConfig
    from transformers.activations import GELUTanh

    from lmpretrain.model.speed import fuse_gelu_tanh

    config = AutoConfig.for_model(
        "gpt2", vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, activation_function=activation
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0  # the same forward, no dropout masks
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config)
    fused = AutoModelForCausalLM.from_config(config)
    fused.load_state_dict(plain.state_dict())
    line = fuse_gelu_tanh(fused)
    kind = {"gelu_new": "NewGELUActivation", "gelu_fast": "FastGELUActivation"}[activation]
    assert (
        line
        == f"activation: 2 {kind} (Python, ~8 kernels) run as torch's gelu(approximate='tanh'), one kernel"
    )
    assert [type(b.mlp.act) for b in fused.transformer.h] == [GELUTanh, GELUTanh]
    assert (
        fused.config.activation_function == activation
        and fused.state_dict().keys() == plain.state_dict().keys()
    )
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    losses = [model(input_ids=ids, labels=ids).loss for model in (plain, fused)]
    for loss in losses:
        loss.backward()
    assert losses[1].item() == pytest.approx(losses[0].item(), rel=1e-6)
    for p, q in zip(plain.parameters(), fused.parameters(), strict=True):
        assert torch.allclose(q.grad, p.grad, rtol=1e-4, atol=1e-7)
    assert fuse_gelu_tanh(fused) is None  # nothing left to swap; Llama's SiLU is one kernel already
