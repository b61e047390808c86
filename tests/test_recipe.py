"""End to end: recipes/pretrain.py on the smoke config in real processes, judged by its artefacts."""

import json
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import recipe_runner as rr
from lmpretrain.analysis.wandb_offline import find_offline_runs, read_offline_run
from lmpretrain.config import load_config
from lmpretrain.data import TrainStream
from lmpretrain.data.tokenizer import load_tokenizer
from lmpretrain.model.build import build_model_config
from lmpretrain.update.schedule import lr_factor

pytestmark = pytest.mark.slow  # end-to-end: launches the recipe in subprocesses

TRAIN_KEYS = {
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "train/clipped",
    "train/tokens_seen",
    "train/epoch",
    "perf/tokens_per_s",
    "perf/step_time_s",
    "perf/data_wait_frac",
    "perf/mfu",
    "perf/peak_mem_bytes",
    "train/skipped_steps",
}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The smoke config exactly as shipped (20 steps, accumulation 2, eval + checkpoint every 10), with
    the default thread count (run.threads=0: every core)."""
    return rr.run(tmp_path_factory.mktemp("smoke") / "run", "--run.threads=0")


# The runs of the tests below that are about the training loop, not the launcher (the smoke run above is
# the launched one): each is `python recipes/pretrain.py ARGS` forked from the fork server (rr.run_each),
# without an interpreter start-up and an `accelerate launch` each.
ACCUM = [
    *rr.QUICK,
    "--train.max_steps=6",
    "--eval.every=0",
    "--checkpoint.every=0",
    "--train.mask_cross_doc_targets=true",
    "--logging.wandb_mode=disabled",
    "--train.param_dtype=float64",
]
PLAIN_LOOP_STEPS, PLAIN_LOOP_SEED = 4, 1337
PLAIN_LOOP = [
    *rr.QUICK,
    f"--train.max_steps={PLAIN_LOOP_STEPS}",
    "--eval.every=0",
    "--checkpoint.every=0",
    "--train.grad_accum_steps=1",
    "--train.micro_batch_size=8",
    "--optim.decay_embeddings=true",
    "--logging.wandb_mode=disabled",
    "--optim.warmup_steps=2",
]
FP16_OVERFLOW = [
    *rr.QUICK,
    "--train.precision=fp16",
    "--train.loss_scale_init=1073741824",
    "--train.max_steps=16",
    "--eval.every=0",
    "--checkpoint.every=0",
    "--logging.wandb_mode=disabled",
]


@pytest.fixture(scope="module")
def loop_runs(smoke, tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    continued = [
        *rr.QUICK,
        f"--model.pretrained={smoke.out / 'final'}",
        "--train.max_steps=6",
        "--optim.warmup_steps=1",
        "--eval.every=0",
        "--logging.wandb_mode=disabled",
    ]
    plan = {
        "k2": [*ACCUM, "--train.micro_batch_size=4", "--train.grad_accum_steps=2"],
        "k1": [*ACCUM, "--train.micro_batch_size=8", "--train.grad_accum_steps=1"],
        "plain_loop": PLAIN_LOOP,
        "fp16": FP16_OVERFLOW,
        "continued": continued,
    }
    logs = rr.run_each([[str(rr.SMOKE), f"--run.output_dir={root / n}", *a] for n, a in plan.items()])
    return {name: rr.Run(root / name, 0, log) for name, log in zip(plan, logs, strict=True)}


def train_rows(run):
    return [r for r in run.metrics() if "train/loss" in r]


def test_smoke_learns(smoke):
    rows = train_rows(smoke)
    assert [r["step"] for r in smoke.metrics()] == list(range(0, 21))  # step 0: the baseline eval
    first, last = rows[0]["train/loss"], rows[-1]["train/loss"]
    assert first == pytest.approx(math.log(8192), abs=0.3)  # a fresh model is uniform over the vocabulary
    assert last < first - 1.0, (first, last)
    evals = [r["eval/loss"] for r in smoke.metrics() if "eval/loss" in r]
    assert len(evals) == 3 and evals[2] < evals[1] < evals[0]
    assert evals[0] == pytest.approx(math.log(8192), abs=0.3)


def test_every_step_logs_the_documented_keys(smoke):
    rows = train_rows(smoke)
    assert len(rows) == 20
    for r in rows:
        assert TRAIN_KEYS <= r.keys(), TRAIN_KEYS - r.keys()
        assert r["train/tokens_seen"] == r["step"] * 8 * 64  # global batch 8 x seq_len 64
        assert 0 <= r["perf/data_wait_frac"] <= 1 and r["perf/tokens_per_s"] > 0 and 0 < r["perf/mfu"] < 1
    eval_rows = [r for r in smoke.metrics() if "eval/loss" in r]
    assert [r["step"] for r in eval_rows] == [0, 10, 20]
    assert all(r["eval/ppl"] == pytest.approx(math.exp(r["eval/loss"])) for r in eval_rows)
    # the held-out set's size and noise: 2 x 8 blocks of 63 targets, each block's loss recorded
    assert all(r["eval/tokens"] == 1008 and 0 < r["eval/loss_se"] < 0.5 for r in eval_rows)
    blocks = [json.loads(line) for line in (smoke.out / "eval_blocks.jsonl").read_text().splitlines()]
    assert [b["step"] for b in blocks] == [0, 10, 20] and all(b["targets"] == [63] * 16 for b in blocks)
    assert sum(blocks[-1]["loss"]) / 1008 == pytest.approx(eval_rows[-1]["eval/loss"], rel=1e-6)
    lrs = [r["train/lr"] for r in rows]
    assert lrs[3] == pytest.approx(3e-3) and lrs[-1] < lrs[4]  # warmup to the peak, then decay


def test_runtime_facts_are_printed(smoke):
    threads = len(os.sched_getaffinity(0))
    assert (
        f"world_size=1 distributed_type=NO backend=None device=cpu threads/process={threads} sharding=none"
        in smoke.output
    )
    assert "optimizer groups: decay:" in smoke.output


def test_export_loads_with_auto_classes_and_pipeline(smoke):
    final = smoke.out / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final)
    assert (final / "model.safetensors").exists()
    assert tokenizer.eos_token and tokenizer.bos_token and tokenizer.pad_token
    ckpt = rr.load_file(smoke.out / "checkpoints" / "step-00000020" / "model.safetensors")
    for name, tensor in ckpt.items():  # the export is the last checkpoint's weights
        assert torch.equal(model.state_dict()[name], tensor), name
    text = pipeline("text-generation", model=model, tokenizer=tokenizer)(
        "def ", max_new_tokens=8, do_sample=False
    )[0]["generated_text"]
    assert text.startswith("def ") and len(text) > 4
    assert "[lmpretrain] sample:" in smoke.output and f"model saved to {final}" in smoke.output


def test_offline_wandb_run_reads_back(smoke):
    (run_dir,) = find_offline_runs(smoke.out)
    run = read_offline_run(run_dir)
    history = [h for h in run["history"] if "train/loss" in h]
    assert [h["_step"] for h in history] == list(range(1, 21))
    assert TRAIN_KEYS <= history[0].keys()
    losses = {r["step"]: r["train/loss"] for r in train_rows(smoke)}
    assert all(h["train/loss"] == pytest.approx(losses[h["_step"]]) for h in history)
    assert [h["_step"] for h in run["history"] if "eval/loss" in h] == [0, 10, 20]
    config = run["config"]
    assert config["train"]["max_steps"] == 20 and config["data"]["seq_len"] == 64
    assert config["params_total"] > 0 and config["runtime"]["world_size"] == 1
    assert config["runtime"]["sharding"] == "none" and config["runtime"]["layout"]["kind"] == "none"
    assert config["peak_flops_source"].startswith("measured:cpu")
    assert config["provenance"]["versions"]["torch"] and config["provenance"]["recipe"].endswith(
        "pretrain.py"
    )


def test_accumulation_equals_one_big_batch_with_uneven_ignored_tokens(loop_runs):
    """B=4 x K=2 == B=8 x K=1 with documents' first tokens ignored (uneven counts per micro-batch).

    float64 parameters: fp32 summation-order noise in near-zero gradients is amplified by Adam's
    normalisation (about 5e-5 relative after 6 steps here), which would hide a real normalisation bug.
    """
    accum, big = loop_runs["k2"], loop_runs["k1"]
    for a, b in zip(accum.metrics(), big.metrics(), strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-9)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-9)
    assert rr.rel_diff(accum.weights(), big.weights()) < 1e-9


def test_first_steps_match_a_plain_pytorch_loop(loop_runs):
    """Same init, same batches: the recipe == torch AdamW + clip_grad_norm_ + SequentialLR + mean CE."""
    steps, seed = PLAIN_LOOP_STEPS, PLAIN_LOOP_SEED
    recipe = loop_runs["plain_loop"]

    cfg = load_config([str(rr.SMOKE), *[o for o in PLAIN_LOOP if not o.startswith("--logging")]])
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    set_seed(seed)
    model = AutoModelForCausalLM.from_config(build_model_config(cfg.model, tokenizer))
    matrices = [p for p in model.parameters() if p.dim() >= 2]  # nanoGPT's rule
    others = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
        lr=cfg.optim.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / 2, total_iters=1),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps - 2, eta_min=cfg.optim.min_lr),
        ],
        milestones=[2],
    )
    data = iter(TrainStream(cfg.data, tokenizer, blocks_per_step=8, rank=0, world_size=1, seed=seed))
    ref_losses = []
    for _ in range(steps):
        ids = next(data).input_ids
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    assert list(recipe.losses().values()) == pytest.approx(ref_losses, rel=1e-5)
    ours = recipe.weights()
    ref = {k: v for k, v in model.state_dict().items() if k in ours}
    assert rr.rel_diff(ours, ref) < 1e-5


def test_fp16_really_runs_and_overflow_skips_keep_the_schedule(loop_runs):
    """A loss scale of 2^30 overflows fp16 gradients: those steps are skipped, the scale halves each
    time, and the learning rate stays where it was until a step really happens."""
    run = loop_runs["fp16"]
    rows = run.metrics()
    skipped = [0] + [r["train/skipped_steps"] for r in rows]
    scale = 2.0**30
    for i, r in enumerate(rows, start=1):
        was_skipped = skipped[i] > skipped[i - 1]
        scale = scale / 2 if was_skipped else scale  # growth needs 2000 clean steps
        assert r["train/loss_scale"] == scale
        assert (r["train/grad_norm"] == r["train/grad_norm"] and r["train/grad_norm"] < 1e30) != was_skipped
        real_steps_before = (i - 1) - skipped[i - 1]  # the schedule advances only on real steps
        assert r["train/lr"] == pytest.approx(
            3e-3 * lr_factor(real_steps_before, warmup_steps=4, max_steps=16, min_ratio=0.1)
        )
    assert skipped[3] == 3 and skipped[-1] < 16  # the first steps overflowed; later ones went through
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]


def test_config_errors_exit_2_with_one_message(tmp_path):
    run = rr.run(tmp_path / "bad", "--train.max_step=5", "--optim.lr=fast", launch=None, check=False)
    assert run.returncode == 2
    assert "unknown key 'train.max_step'; did you mean 'max_steps'?" in run.output
    assert "optim.lr: expected float, got 'fast'" in run.output
    assert "Traceback" not in run.output and not (tmp_path / "bad").exists()


def test_cross_field_errors_are_reported_together_before_work(tmp_path):
    run = rr.run(
        tmp_path / "bad",
        "--data.seq_len=512",
        "--model.overrides.vocab_size=100",
        "--optim.warmup_steps=50",
        launch=None,
        check=False,
    )
    assert run.returncode == 2, run.output
    assert "3 problem(s)" in run.output
    assert "data.seq_len=512 exceeds the model's 128 positions" in run.output
    assert "tokenizer 'builtin:python-stdlib' has 8192 tokens but the model's vocab_size is 100" in run.output
    assert "optim.warmup_steps=50 must be < train.max_steps=20" in run.output
    assert not (tmp_path / "bad").exists()


def test_unwritable_output_dir_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory should be")
    run = rr.run(blocker / "run", launch=None, check=False)
    assert run.returncode == 2 and "output" in run.output.lower() and "Traceback" not in run.output
    assert "pretrain:" not in run.output  # no progress bar: nothing started


def test_continued_pretraining_from_an_exported_model(smoke, loop_runs):
    """model.pretrained loads the weights (the model type and shape come from the saved config)."""
    cont = loop_runs["continued"]
    first = cont.metrics()[0]["train/loss"]
    fresh = train_rows(smoke)[0]["train/loss"]
    assert first < train_rows(smoke)[-1]["train/loss"] + 0.5 < fresh  # starts where the smoke run ended


ENDS_WITH_A_THREAD_POOL = """\
import atexit, sys
from concurrent.futures import ThreadPoolExecutor
sys.pool = ThreadPoolExecutor(1)  # held past the script's end, as inductor holds its compile workers' pool
sys.pool.submit(print, "pooled", flush=True).result()
atexit.register(print, "exit handler ran")
sys.exit(3)
"""


def test_a_forked_run_ends_as_the_interpreter_ends_a_script(tmp_path):
    """A run leaving a thread pool alive (torch.compile's first compile does) still ends, with the script's
    status and its exit handlers run: what `python SCRIPT` does (a fork that only joined the threads
    waited on the pool forever)."""
    script = tmp_path / "pool.py"
    script.write_text(ENDS_WITH_A_THREAD_POOL)
    forked = rr.run(tmp_path / "out", launch=None, recipe=script, check=False, timeout=60)
    python = rr.run_command([sys.executable, str(script)], tmp_path / "out", check=False, timeout=60)
    assert (
        (forked.returncode, forked.output)
        == (python.returncode, python.output)
        == (3, "pooled\nexit handler ran\n")
    )
