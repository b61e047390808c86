"""train.ema_decay and train.batch_ramp through the recipe: the EMA is the average of the weights the run
logged, training is bit-identical with and without it, one process = DDP = FSDP2 (float64), checkpoints
(full and sharded) resume it bit-exactly inside a ramp stage, at its boundary and after kill -9, and
final-ema/ is a model that loads and generates."""

import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM, AutoTokenizer

import recipe_runner as rr

pytestmark = pytest.mark.slow  # end-to-end: launches the recipe in subprocesses

DECAY = 0.8
# 64-token blocks: steps 1-4 take 4 blocks (1024 tokens), then the config's 8; the EMA starts at step 2.
RAMP = ["--train.batch_ramp=[{until_tokens: 1000, global_batch: 4}]"]
EMA = [f"--train.ema_decay={DECAY}", "--train.ema_start=2"]
ONE = [*rr.EXACT, *RAMP, *EMA, "--checkpoint.every=1", "--checkpoint.keep_last=20"]
TWO = [*rr.EXACT, *RAMP, *EMA, "--train.micro_batch_size=2", "--train.grad_accum_steps=2"]
TIMEOUT = 300


@pytest.fixture(scope="module")
def singles(tmp_path_factory):
    """One process: with the EMA (a checkpoint every step), and without it (same ramp)."""
    root = tmp_path_factory.mktemp("single")
    plain = [a for a in ONE if not a.startswith("--train.ema")]
    args = [
        [str(rr.SMOKE), f"--run.output_dir={root / name}", *a] for name, a in (("ema", ONE), ("plain", plain))
    ]
    logs = rr.run_each(args, timeout=TIMEOUT)
    return [rr.Run(root / name, 0, log) for name, log in zip(("ema", "plain"), logs, strict=True)]


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    args = [*TWO, "--checkpoint.every=2", "--checkpoint.keep_last=5"]
    return rr.run(tmp_path_factory.mktemp("fsdp") / "run", *args, launch="cpu-fsdp", timeout=TIMEOUT)


def ckpt(run: rr.Run, step: int):
    return run.out / "checkpoints" / f"step-{step:08d}"


def test_the_ema_is_the_average_of_the_logged_weights(singles):
    run = singles[0]
    assert (
        f"trainable parameters (decay {DECAY}, from step 2): one float64 copy of the parameters" in run.output
    )
    expected = None
    for step in range(2, 11):
        weights = load_file(ckpt(run, step) / "model.safetensors")
        saved = load_file(ckpt(run, step) / "ema.safetensors")
        if expected is None:  # updates up to ema_start copy the weights
            expected = {k: weights[k].double() for k in saved}
        else:
            expected = {k: DECAY * expected[k] + (1 - DECAY) * weights[k].double() for k in saved}
        for k, v in saved.items():
            assert v.dtype == torch.float64 and (v - expected[k]).abs().max() <= 1e-12, (step, k)
    rows = {r["step"]: r for r in run.metrics()}
    assert rows[0]["eval/ema/loss"] == rows[0]["eval/loss"]  # the average starts as the weights
    assert rows[10]["eval/ema/loss"] != rows[10]["eval/loss"] and "eval/ema/bpb" in rows[10]
    assert "eval/ema/loss" not in rows[3]
    assert [rows[s]["train/global_batch"] for s in range(1, 11)] == [4] * 4 + [8] * 6
    assert [rows[s]["train/tokens_seen"] for s in range(1, 11)] == [256 * s for s in range(1, 5)] + [
        1024 + 512 * s for s in range(1, 7)
    ]


def test_training_is_bit_identical_with_and_without_the_ema(singles):
    ema, plain = singles
    for x, y in zip(ema.metrics(), plain.metrics(), strict=True):
        keys = ("train/loss", "train/grad_norm", "train/lr", "eval/loss", "eval/bpb")
        assert [x.get(k) for k in keys] == [y.get(k) for k in keys], x["step"]
        assert not any(k.startswith("eval/ema/") for k in y)
    assert rr.file_sha256(ema.out / "final/model.safetensors") == rr.file_sha256(
        plain.out / "final/model.safetensors"
    )
    assert not (plain.out / "final-ema").exists()


def test_final_ema_loads_and_generates(singles):
    run = singles[0]
    model = AutoModelForCausalLM.from_pretrained(run.out / "final-ema", dtype=torch.float64)
    tok = AutoTokenizer.from_pretrained(run.out / "final-ema")
    for name, tensor in load_file(ckpt(run, 10) / "ema.safetensors").items():
        assert torch.equal(model.state_dict()[name], tensor), name
    ids = tok("def ", return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 6
    assert f"EMA saved to {run.out / 'final-ema'}" in run.output


def test_one_process_ddp_and_fsdp2_agree_with_ema_and_ramp(singles, fsdp, tmp_path):
    ddp = rr.run(tmp_path / "ddp", *TWO, launch="cpu-ddp", timeout=TIMEOUT)
    one = singles[0]
    for other in (ddp, fsdp):
        for x, y in zip(one.metrics(), other.metrics(), strict=True):
            assert x.keys() == y.keys(), x["step"]
            assert x.get("train/global_batch") == y.get("train/global_batch")
            assert x.get("train/tokens_seen") == y.get("train/tokens_seen")
            for key in ("train/loss", "eval/loss", "eval/ema/loss", "train/lr"):
                assert x.get(key, 0.0) == pytest.approx(y.get(key, 0.0), rel=1e-6), (key, x["step"])
        a, b = (load_file(r.out / "final-ema/model.safetensors") for r in (one, other))
        assert rr.rel_diff(a, b) < 1e-6
    assert "sharding=fsdp2" in fsdp.output and "(this rank shard)" in fsdp.output


def test_a_sharded_ema_checkpoint_resumes_on_one_process_inside_a_ramp_stage(fsdp, tmp_path):
    keys = FileSystemReader(str(ckpt(fsdp, 2) / "dcp")).read_metadata().state_dict_metadata
    assert any(k.startswith("averages.ema.model.layers.0.") for k in keys)
    out = tmp_path / "one"
    shutil.copytree(fsdp.out, out)
    shutil.rmtree(out / "final")
    for c in (out / "checkpoints").glob("step-*"):
        if c.name != "step-00000002":
            shutil.rmtree(c)
    one = rr.run(
        out, *TWO, "--train.micro_batch_size=4", "--train.grad_accum_steps=2", launch="cpu", timeout=TIMEOUT
    )
    assert "world_size=1" in one.output and "at step 2" in one.output
    ref = {r["step"]: r for r in fsdp.metrics()}
    for r in one.metrics()[-8:]:
        assert r["train/global_batch"] == ref[r["step"]]["train/global_batch"]
        assert r.get("eval/ema/loss", 0.0) == pytest.approx(
            ref[r["step"]].get("eval/ema/loss", 0.0), rel=1e-6
        )
    a, b = (load_file(r.out / "final-ema/model.safetensors") for r in (one, fsdp))
    assert rr.rel_diff(a, b) < 1e-6


def assert_same_run(straight: rr.Run, resumed: rr.Run) -> None:
    for name in ("final/model.safetensors", "final-ema/model.safetensors"):
        assert rr.file_sha256(straight.out / name) == rr.file_sha256(resumed.out / name), name
    assert [r["step"] for r in resumed.metrics()] == list(range(0, 11))  # none missing, none twice
    keys = (
        "train/loss",
        "train/grad_norm",
        "train/lr",
        "train/global_batch",
        "train/tokens_seen",
        "eval/ema/loss",
    )
    for x, y in zip(straight.metrics(), resumed.metrics(), strict=True):
        assert [x.get(k) for k in keys] == [y.get(k) for k in keys], x["step"]


def test_resume_inside_a_stage_at_its_boundary_and_after_kill_9_is_bit_identical(singles, tmp_path):
    straight = singles[0]
    copies = []
    for step in (2, 4):  # inside the 4-block stage; its last step (the next one takes 8 blocks)
        out = tmp_path / f"from-{step}"
        shutil.copytree(straight.out, out)
        shutil.rmtree(out / "final")
        shutil.rmtree(out / "final-ema")
        for c in (out / "checkpoints").glob("step-*"):
            if int(c.name.split("-")[1]) > step:
                shutil.rmtree(c)
        copies.append(out)
    logs = rr.run_each([[str(rr.SMOKE), f"--run.output_dir={o}", *ONE] for o in copies], timeout=TIMEOUT)
    for out, log, step in zip(copies, logs, (2, 4), strict=True):
        assert f"at step {step}" in log
        assert_same_run(straight, rr.Run(out, 0, log))

    killed = tmp_path / "killed"
    with open(tmp_path / "killed.log", "w") as log:
        proc = rr.start_forked(killed, *ONE, launch=None, log=log)
        rr.wait_for_step(proc, killed, 3, timeout=TIMEOUT)
        rr.kill_tree(proc, signal.SIGKILL)
        proc.wait(timeout=60)
    assert rr.read_metrics(killed)[-1]["step"] < 10, "the run finished before it could be killed"
    resumed = rr.run(killed, *ONE, launch=None, timeout=TIMEOUT)
    assert "resumed from" in resumed.output
    assert_same_run(straight, resumed)
