"""train.on_spike=rollback end to end: a training source whose clean code is interrupted by a planted
stretch of random characters spikes the loss; the run reloads the last checkpoint, skips the data read
since it (the planted stretch included) and finishes; a rerun ends with bit-identical weights.

The source is read in order (one stream, no shuffle) so the planted stretch's step is known: each step
reads 8 blocks x 64 tokens = 512 tokens of the concatenated documents (BOS + text + EOS each).
"""

import json
import random

import pytest
import torch
from safetensors.torch import load_file

import recipe_runner as rr
from lmpretrain.data import load_tokenizer

pytestmark = pytest.mark.slow  # end-to-end: two recipe runs

STEP_TOKENS = 8 * 64
CLEAN = [
    f"def add_{i}(x):\n    return x + {i}\n\n\nclass Point{i}:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n"
    for i in range(400)
]
PLANT_AT = 172  # documents before the planted one


def write_source(folder):
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!@#$%^&*()[]{};:,.<>?/"
    noise = "".join(rng.choice(alphabet) for _ in range(400))
    docs = [*CLEAN[:PLANT_AT], noise, *CLEAN[PLANT_AT:]]
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (folder / "val.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in CLEAN[:40]))
    tok = load_tokenizer("builtin:python-stdlib")
    sizes = [len(tok(d)["input_ids"]) + 2 for d in docs]  # + BOS and EOS
    return sum(sizes[:PLANT_AT]), sum(sizes[: PLANT_AT + 1])  # the planted tokens' [start, end)


def test_a_planted_spike_is_rolled_back_past_its_data_and_a_rerun_is_bit_identical(tmp_path):
    planted = write_source(tmp_path)
    args = [
        "configs/smoke.yaml",
        *rr.QUICK,
        f"--data.train=[{{files: [{tmp_path / 'train.jsonl'}]}}]",
        f"--data.eval=[{{files: [{tmp_path / 'val.jsonl'}]}}]",
        "--data.shuffle=none",
        "--data.num_streams=1",
        "--train.max_steps=22",
        "--checkpoint.every=6",
        "--checkpoint.keep_last=5",
        "--eval.every=0",
        "--logging.wandb_mode=disabled",
        "--train.skip_spikes=true",
        "--train.spike_window=8",
        "--train.spike_sigma=2",
        "--train.on_spike=rollback",
    ]
    outs = [tmp_path / "run", tmp_path / "rerun"]
    logs = rr.run_each([[*args, f"--run.output_dir={out}"] for out in outs])
    lines = [line[line.index("the loss spiked") :] for line in logs[0].splitlines() if "rolled back" in line]
    assert lines == [
        "the loss spiked at step 16: rolled back to step-00000012 (step 12); the data of steps "
        "13-16 (4 steps, 2,048 tokens) is skipped, never trained on (rollback 1 of at most 3)"
    ], logs[0][-3000:]
    # the steps rolled back read tokens [12 * 512, 16 * 512): the planted stretch lies inside them
    assert 12 * STEP_TOKENS <= planted[0] and planted[1] <= 16 * STEP_TOKENS
    rows = {r["step"]: r for r in rr.read_metrics(outs[0]) if "train/loss" in r}
    assert [rows[s]["train/rollbacks"] for s in (15, 16, 22)] == [0, 1, 1]
    assert rows[22]["train/rolled_back_steps"] == 4 and rows[22]["train/rolled_back_tokens"] == 2048
    assert rows[22]["train/skipped_steps"] == 4  # the schedule follows the 18 updates applied
    losses = [rows[s]["train/loss"] for s in range(12, 23)]
    assert max(losses[17 - 12 :]) < losses[16 - 12] - 1, losses  # past the planted data: no spike again
    a, b = (load_file(out / "final" / "model.safetensors") for out in outs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["train/loss"] for r in rows.values()] == [
        r["train/loss"] for r in rr.read_metrics(outs[1]) if "train/loss" in r
    ]
