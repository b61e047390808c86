"""FSDP2 through the recipe on 2 CPU processes over gloo (configs/accelerate/cpu-fsdp.yaml).

accelerate's own FSDP2 code shards the model (the recipe switches it on for CPU process groups), so the
loop, accumulation without gradient sync, clipping, evaluation, samples, sharded checkpoints and the
export run the code a GPU launch runs. Every run has a timeout: a rank left waiting in a collective
fails the test instead of hanging it.
"""

import json
import re
import shutil
import signal
import textwrap

import plan_check
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM, AutoTokenizer

import recipe_runner as rr

pytestmark = pytest.mark.slow  # end-to-end: launches the recipe in subprocesses

FSDP = "cpu-fsdp"
# The DDP run of the two_ranks_accum2 fixture (float64, accumulation 2), plus samples at every eval
# (greedy: no RNG, so they change nothing) and a checkpoint every 4 steps to resume from (all kept).
EXACT = [
    *rr.EXACT,
    "--train.micro_batch_size=2",
    "--train.grad_accum_steps=2",
    "--eval.sample_tokens=8",
    "--checkpoint.every=4",
    "--checkpoint.keep_last=3",
]
TIMEOUT = 300


@pytest.fixture(scope="session")
def fsdp_run(tmp_path_factory):
    return rr.run(tmp_path_factory.mktemp("fsdp") / "run", *EXACT, launch=FSDP, timeout=TIMEOUT)


def test_fsdp2_runs_what_it_says(fsdp_run):
    out = fsdp_run.output
    assert "world_size=2 distributed_type=FSDP backend=gloo" in out
    assert "sharding=fsdp2 (accelerate's FSDP2 over gloo, switched on by the recipe on cpu)" in out
    assert "FSDP2: 6 fully_shard units (root, model.embed_tokens, model.layers.0, model.layers.1" in out
    assert "rank 0 holds 308,384 of 616,768 parameter values (DTensor shards)" in out
    # built on meta: each rank filled only its shards (bit-identical to a host build: tests/test_meta_init.py)
    assert "model init: on meta, this rank filled its own shards (308,384 of 616,768 parameters)" in out
    assert "checkpoints: format=sharded: torch.distributed.checkpoint" in out and "; sync;" in out
    assert "Setting accelerator to CPU" not in out  # DeepSpeed is not imported


def test_fsdp2_trains_like_ddp_in_float64(fsdp_run, two_ranks_accum2):
    """Same losses, grad norms and weights as DDP over 10 steps with accumulation 2."""
    for x, y in zip(fsdp_run.metrics(), two_ranks_accum2.metrics(), strict=True):
        assert x.keys() == y.keys(), x["step"]
        for key in ("train/loss", "train/grad_norm", "eval/loss", "train/lr"):
            assert x.get(key, 0.0) == pytest.approx(y.get(key, 0.0), rel=1e-6), (key, x["step"])
    assert max(r["train/grad_norm"] for r in fsdp_run.metrics() if "train/grad_norm" in r) > 1.0  # clipped
    assert rr.rel_diff(fsdp_run.weights(), two_ranks_accum2.weights()) < 1e-6


@pytest.mark.parametrize("launch", ["cpu-ddp", FSDP])
def test_the_plan_says_what_the_run_sent_and_held(launch, fsdp_run, two_ranks_accum2):
    """`python -m lmpretrain.plan` of these runs' configs at 2 ranks against what step 2 of the real runs did
    on rank 0 (logging.bytes_at_step): parameter, gradient and optimizer bytes exactly, each collective
    kind within 2% (DDP: the gradient all-reduce; FSDP2: its all-gathers and, once a step under accumulation,
    its reduce-scatters)."""
    run = two_ranks_accum2 if launch == "cpu-ddp" else fsdp_run
    figures, off = plan_check.compare(run, launch)
    wire = ("all_reduce",) if launch == "cpu-ddp" else ("all_gather", "reduce_scatter")
    assert all(figures[kind][1] > figures["params"][1] / 2 for kind in wire), figures
    assert off == [], figures


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_fsdp2_with_every_speed_switch_trains_like_ddp(checkpointing, two_ranks_accum2, tmp_path):
    """Compile, activation checkpointing (full or selective), the chunked loss (through the root's gathered
    output embedding), fused AdamW and sdpa, applied before sharding: same run as DDP without them."""
    switches = [
        "--train.compile=true",
        f"--train.activation_checkpointing={checkpointing}",
        "--train.loss_impl=chunked",
        "--train.loss_chunk_tokens=96",  # does not divide the micro-batch's rows
        "--optim.fused=true",
        "--model.attn_implementation=sdpa",
    ]
    run = rr.run(
        tmp_path / "run",
        *rr.EXACT,
        "--train.micro_batch_size=2",
        "--train.grad_accum_steps=2",
        *switches,
        launch=FSDP,
        timeout=TIMEOUT,
    )
    assert "compile: 2 LlamaDecoderLayer blocks" in run.output and "AdamW implementation: fused" in run.output
    assert (
        f"activation checkpointing: {checkpointing}, 2 blocks" in run.output
        and "loss: chunked (96 tokens" in run.output
    )
    for x, y in zip(run.metrics(), two_ranks_accum2.metrics(), strict=True):
        for key in ("train/loss", "train/grad_norm", "eval/loss"):
            assert x.get(key, 0.0) == pytest.approx(y.get(key, 0.0), rel=1e-5), (key, x["step"])
    # Compiled kernels and sdpa compute Llama's fp32 parts in another order (see test_speed.py).
    assert rr.rel_diff(run.weights(), two_ranks_accum2.weights()) < 1e-5


def optimizer_bytes_per_file(checkpoint) -> dict[str, int]:
    """Bytes of optimizer state each DCP file holds (each rank writes the shards it holds)."""
    metadata = FileSystemReader(str(checkpoint / "dcp")).read_metadata()
    per_file: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("optimizer.state.") and not index.fqn.endswith(".step"):
            per_file[info.relative_path] = per_file.get(info.relative_path, 0) + info.length
    return per_file


def test_each_rank_holds_about_half_the_optimizer_state(fsdp_run, two_ranks_accum2):
    full = torch.load(
        two_ranks_accum2.out / "checkpoints" / "step-00000010" / "optimizer.pt", weights_only=True
    )
    total = sum(
        v.numel() * v.element_size() for s in full["state"].values() for k, v in s.items() if k != "step"
    )
    per_rank = optimizer_bytes_per_file(fsdp_run.out / "checkpoints" / "step-00000010")
    assert sorted(per_rank) == ["__0_0.distcp", "__1_0.distcp"]
    # Serialisation adds a little per tensor; the moments themselves split about evenly.
    assert sum(per_rank.values()) == pytest.approx(total, rel=0.02)
    assert all(abs(n - total / 2) < 0.1 * total for n in per_rank.values()), (per_rank, total)


def test_samples_and_the_final_export_work(fsdp_run):
    samples = [json.loads(line) for line in (fsdp_run.out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 5, 10] and all(
        s["generation"].startswith("def") for s in samples
    )
    final = fsdp_run.out / "final"
    assert not list(fsdp_run.out.glob(".tmp-final-*"))
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float64)
    AutoTokenizer.from_pretrained(final)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, stored once
    for name, tensor in fsdp_run.weights().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert "[lmpretrain] sample: 'def" in fsdp_run.output and f"model saved to {final}" in fsdp_run.output


def assert_same_run(straight: rr.Run, resumed: rr.Run) -> None:
    assert rr.file_sha256(straight.out / "final" / "model.safetensors") == rr.file_sha256(
        resumed.out / "final" / "model.safetensors"
    )
    assert [r["step"] for r in resumed.metrics()] == list(range(0, 11))  # none missing, none twice
    for x, y in zip(straight.metrics(), resumed.metrics(), strict=True):
        keys = ("train/loss", "train/grad_norm", "eval/loss")
        assert [x.get(k) for k in keys] == [y.get(k) for k in keys], x["step"]


def test_kill_9_during_async_saves_then_resume_is_bit_identical(fsdp_run, tmp_path):
    out = tmp_path / "killed"
    args = [*EXACT, "--checkpoint.async_save=true"]
    with open(tmp_path / "killed.log", "w") as log:
        proc = rr.start_forked(out, *args, launch=FSDP, log=log)
        rr.wait_for_step(proc, out, 6, timeout=TIMEOUT)
        rr.kill_tree(proc, signal.SIGKILL)
        proc.wait(timeout=60)
    killed_at = rr.read_metrics(out)[-1]["step"]
    assert killed_at < 10, "the run finished before it could be killed"
    assert "async (background write, committed once complete)" in (tmp_path / "killed.log").read_text()
    resumed = rr.run(out, *args, launch=FSDP, timeout=TIMEOUT)  # also: the killed run left no lock
    resumed_at = int(re.search(r"resumed from \S+ at step (\d+)", resumed.output).group(1))
    assert resumed_at in (4, 8) and resumed_at <= killed_at
    assert_same_run(fsdp_run, resumed)


def test_sigterm_to_the_launcher_saves_and_resumes_bit_identical(fsdp_run, tmp_path):
    """The signal goes to `accelerate launch` only; it forwards SIGTERM to the ranks, which save the
    step they are at and exit well inside its grace period. In the full format (rank 0 writes, rank 0
    reads and broadcasts; the kill -9 test above resumes the sharded one)."""
    out = tmp_path / "terminated"
    args = [*EXACT, "--checkpoint.format=full"]
    with open(tmp_path / "terminated.log", "w") as log:
        proc = rr.start(out, *args, launch=FSDP, log=log)
        rr.wait_for_step(proc, out, 2, timeout=TIMEOUT)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    log = (tmp_path / "terminated.log").read_text()
    stopped_at = rr.read_metrics(out)[-1]["step"]
    assert stopped_at < 10 and f"stopped by signal after step {stopped_at}" in log
    assert log.count("received SIGTERM: will save after this step and exit") == 2  # both ranks
    saved = float(log.split(f"step-{stopped_at:08d} (in ")[1].split(" s)")[0])
    assert saved < 30 / 2  # well inside the launcher's default grace (30 s)
    resumed = rr.run(out, *args, launch=FSDP, timeout=TIMEOUT)
    assert f"at step {stopped_at}" in resumed.output
    assert_same_run(fsdp_run, resumed)


def test_a_sharded_checkpoint_resumes_on_one_process(fsdp_run, tmp_path):
    """DCP reshards the 2-rank shards into one whole model; the data position carries over exactly."""
    out = tmp_path / "one"
    shutil.copytree(fsdp_run.out, out)
    shutil.rmtree(out / "final")
    for ckpt in (out / "checkpoints").glob("step-*"):
        if ckpt.name != "step-00000004":
            shutil.rmtree(ckpt)
    one = rr.run(out, *EXACT, "--train.micro_batch_size=4", launch="cpu", timeout=TIMEOUT)  # no flag needed
    assert "world_size=1" in one.output and "at step 4" in one.output
    assert "resuming with another layout (world_size 2 -> 1, micro_batch_size 2 -> 4)" in one.output
    ref = fsdp_run.losses()
    assert [one.losses()[s] for s in range(5, 11)] == pytest.approx([ref[s] for s in range(5, 11)], rel=1e-6)
    assert rr.rel_diff(one.weights(), fsdp_run.weights()) < 1e-6


FP16_WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    from accelerate import PartialState
    from torch.distributed.fsdp import fully_shard
    from lmpretrain.model.precision import MixedPrecision

    state = PartialState(cpu=True)
    rank = state.process_index
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    precision = MixedPrecision("fp16", torch.device("cpu"), init_scale=1024.0)
    results = []
    for poisoned in (True, False):
        with precision.autocast():
            y = model(torch.randn(4, 16))
        precision.scale(y.float().pow(2).mean()).backward()
        if poisoned and rank == 1:  # an overflow in rank 1's shard only: rank 0's shards are finite
            next(model.parameters()).grad.to_local()[0, 0] = float("inf")
        local_finite = all(torch.isfinite(p.grad.to_local()).all().item() for p in model.parameters())
        before = [p.detach().to_local().clone() for p in model.parameters()]
        precision.unscale_(optimizer)
        stepped = precision.step(optimizer)
        optimizer.zero_grad()
        changed = any(not torch.equal(a, p.detach().to_local()) for a, p in zip(before, model.parameters()))
        results.append({"local_finite": local_finite, "stepped": stepped, "changed": changed,
                        "scale": precision.loss_scale})
    with open(os.path.join(sys.argv[1], f"rank-{rank}.json"), "w") as f:
        json.dump(results, f)
    state.wait_for_everyone()
    state.destroy_process_group()
""")


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """Under FSDP2 each rank checks its own gradient shards; torch's DTensor dispatch all-reduces the
    scaler's found-inf flag (max over the mesh), so the skip and the scale back-off agree everywhere."""
    script = tmp_path / "worker.py"
    script.write_text(FP16_WORKER)
    rr.launch_ranks(script, str(tmp_path), timeout=TIMEOUT)
    poisoned, clean = zip(
        *(json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)), strict=True
    )
    assert [r["local_finite"] for r in poisoned] == [True, False]  # only rank 1 saw the inf
    assert all(not r["stepped"] and not r["changed"] and r["scale"] == 512.0 for r in poisoned)
    assert all(r["stepped"] and r["changed"] and r["scale"] == 512.0 for r in clean)


def test_checkpoints_carry_an_eval_loss_only_when_an_eval_ran_at_their_step(fsdp_run):
    """The "best" checkpoint is picked by this value: a stale eval loss must not count."""
    metas = {
        int(p.name.split("-")[1]): json.loads((p / "meta.json").read_text())
        for p in (fsdp_run.out / "checkpoints").glob("step-*")
    }
    evals = {r["step"]: r["eval/loss"] for r in fsdp_run.metrics() if "eval/loss" in r}
    assert sorted(metas) == [4, 8, 10] and sorted(evals) == [0, 5, 10]
    assert metas[4]["eval_loss"] is None and metas[8]["eval_loss"] is None
    assert metas[10]["eval_loss"] == evals[10] and metas[10]["format"] == "sharded"
