"""End to end: the schedule follows the config given at resume (a tenth of the lr, a finished run
extended, a wsd run annealed from its stable phase), and spike skipping resumes bit-exactly.

One base run (wsd, spike skipping on a short window, checkpoints at steps 8, 16 and 20) is resumed four
ways, each into its own output dir with `--run.resume=<checkpoint>` (forked from the fork server,
tests/fork_server.py: no interpreter start-up each).
"""

import json

import pytest
import torch

import recipe_runner as rr
from lmpretrain.config import load_config
from lmpretrain.update.schedule import learning_rate

pytestmark = pytest.mark.slow  # end-to-end: launches the recipe in subprocesses

BASE = [
    *rr.QUICK,
    "--optim.schedule=wsd",  # 20 steps, decay_fraction 0.2: stable until update 16, then decays
    "--train.skip_spikes=true",
    "--train.spike_window=4",  # short enough for this run's small loss bumps to count as spikes
    "--train.spike_sigma=1",
    "--data.doc_shuffle_window=64",  # the document order whose one loss bump this window judges a spike
    "--checkpoint.every=8",
    "--checkpoint.keep_last=5",
    "--eval.every=0",
    "--logging.wandb_mode=offline",
]
RESUMES = {
    "exact": (16, []),
    "tenth_lr": (8, ["--optim.lr=3e-4", "--optim.min_lr=3e-5"]),
    "extended": (20, ["--train.max_steps=24"]),
    # The documented annealing command: decay the last 20% of 10 steps, i.e. from step 8 on.
    "annealed": (8, ["--train.max_steps=10", "--optim.decay_fraction=0.2"]),
}


def checkpoint(out, step):
    return out / "checkpoints" / f"step-{step:08d}"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return rr.run(tmp_path_factory.mktemp("hparams") / "base", *BASE, launch=None)


@pytest.fixture(scope="module")
def resumed(base):
    args = {
        name: [str(rr.SMOKE), *BASE, *extra, f"--run.resume={checkpoint(base.out, step)}"]
        + [f"--run.output_dir={base.out.parent / name}"]
        for name, (step, extra) in RESUMES.items()
    }
    logs = rr.run_each(list(args.values()))
    return {
        name: (rr.Run(base.out.parent / name, 0, log), cfg)
        for (name, cfg), log in zip(args.items(), logs, strict=True)
    }


def train_rows(run):
    return [r for r in run.metrics() if "train/loss" in r]


def assert_lr_follows_the_schedule(rows, cfg, skipped_before_first):
    """Row of step s trains with the lr of update (s - 1 - steps skipped before it): skipped steps
    (counted in train/skipped_steps) do not advance the schedule."""
    skipped = skipped_before_first
    for r in rows:
        assert r["train/lr"] == pytest.approx(learning_rate(cfg, r["step"] - 1 - skipped), rel=1e-12), r[
            "step"
        ]
        skipped = r["train/skipped_steps"]


def test_base_run_skips_a_spike_once_and_its_schedule_waits(base):
    rows = train_rows(base)
    skipped = [r["train/skipped_steps"] for r in rows]
    spike = skipped.index(1)  # the one loss bump this short window judges a spike
    assert skipped == [0] * spike + [1] * (len(rows) - spike)
    assert rows[spike]["train/loss"] > rows[spike - 1]["train/loss"]
    assert rows[spike]["step"] > 16  # after the checkpoint the "exact" resume starts from (its window)
    assert base.output.count("is a spike (train.skip_spikes)") == 1
    assert_lr_follows_the_schedule(rows, load_config([str(rr.SMOKE), *BASE]), 0)


def test_spike_skipping_resumes_bit_exactly(base, resumed):
    """The spike window lives in the checkpoint: resumed at step 16, the run skips the spike after it as
    the straight run did (with an empty window it could not judge it) and ends with identical weights."""
    run, _ = resumed["exact"]
    straight = {r["step"]: r for r in train_rows(base)}
    for r in train_rows(run):
        for key in ("train/loss", "train/grad_norm", "train/lr", "train/skipped_steps"):
            assert r[key] == straight[r["step"]][key], (r["step"], key)
    assert [r["step"] for r in train_rows(run)] == [17, 18, 19, 20]
    assert "resumed with new hyper-parameters" not in run.output
    ours, theirs = run.weights(), base.weights()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_resume_with_a_tenth_of_the_lr(base, resumed):
    run, args = resumed["tenth_lr"]
    assert run.output.count("resumed with new hyper-parameters") == 1
    assert (
        "resumed with new hyper-parameters from step 8: optim.lr 0.003 -> 0.0003, optim.min_lr 0.0003 -> "
        "3e-05 (lr 0.003 -> 0.0003; wsd decays over updates 16..20)" in run.output
    )
    rows = train_rows(run)
    assert [r["step"] for r in rows] == list(range(9, 21))
    assert rows[0]["train/lr"] == pytest.approx(train_rows(base)[8]["train/lr"] / 10, rel=1e-12)
    assert_lr_follows_the_schedule(rows, load_config(args), 0)


def test_extend_a_finished_run(base, resumed):
    run, args = resumed["extended"]
    assert "resumed with new hyper-parameters from step 20: train.max_steps 20 -> 24" in run.output
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [21, 22, 23, 24]
    assert_lr_follows_the_schedule(rows, load_config(args), train_rows(base)[-1]["train/skipped_steps"])
    assert json.loads((run.out / "final" / "config.json").read_text())["model_type"] == "llama"
    assert "done: step 24" in run.output


def test_anneal_a_wsd_run_from_its_stable_phase(base, resumed):
    run, args = resumed["annealed"]
    assert (
        "resumed with new hyper-parameters from step 8: train.max_steps 20 -> 10 "
        "(lr 0.003 -> 0.003; wsd decays over updates 8..10)" in run.output
    )
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [9, 10]
    # the decay starts at the checkpoint's step: the base run was still at the peak there
    assert train_rows(base)[8]["train/lr"] == rows[0]["train/lr"] == 3e-3
    assert rows[1]["train/lr"] == pytest.approx(3e-4 + (3e-3 - 3e-4) * (1 - 0.5**0.5), rel=1e-12)
    assert_lr_follows_the_schedule(rows, load_config(args), 0)
    assert "done: step 10" in run.output
    # a branch into its own output dir is a W&B run of its own (the base run's steps 9-10 stay as they were)
    ids = [
        torch.load(checkpoint(r.out, step) / "states.pt", weights_only=True)["train"]["wandb_run_id"]
        for r, step in ((base, 8), (run, 10))
    ]
    assert None not in ids and ids[0] != ids[1]
