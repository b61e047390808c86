"""One big text file, the most common corpus people bring: a generated 220 MB file with 8 streams trains,
its memory does not grow with the file, and kill -9 + resume is bit-identical."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys

import pytest

import recipe_runner as rr

pytestmark = pytest.mark.slow  # end-to-end: launches the recipe in subprocesses

BLOCK_BYTES = 1 << 20
_WORDS = "def return self class import for while if else None True False lambda yield with as".split()


@pytest.fixture(scope="session")
def big_text(tmp_path_factory):
    """(220 MB file, 22 MB file): Python-like numbered lines, 8 distinct 1 MiB blocks in a seeded order."""
    rng = random.Random(0)
    blocks = []
    for b in range(8):
        lines, size = [], 0
        while size < BLOCK_BYTES:
            line = f"    x{b}_{len(lines)} = {' '.join(rng.choices(_WORDS, k=rng.randint(2, 12)))}\n"
            lines.append(line)
            size += len(line)
        blocks.append("".join(lines).encode())
    folder = tmp_path_factory.mktemp("big_text")
    paths = []
    for name, n in (("big.txt", 210), ("small.txt", 21)):
        with open(folder / name, "wb") as f:
            for i in range(n):
                f.write(f"# block {i}\n".encode() + blocks[rng.randrange(8)])
        paths.append(folder / name)
    return paths


LOADER = """
import json, resource, sys
from lmpretrain.config import DataConfig
from lmpretrain.data import SourceSpec, TrainStream
from lmpretrain.data.tokenizer import load_tokenizer
data = DataConfig(train=[SourceSpec(files=[sys.argv[1]])], seq_len=256, num_streams=8)
ts = TrainStream(data, load_tokenizer("builtin:python-stdlib"), blocks_per_step=16, rank=0, world_size=1, seed=0)
it = iter(ts)
for _ in range(40):
    next(it)
print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "pieces": len(ts.sources[0].pieces(8))}))
"""


def test_the_loaders_memory_does_not_grow_with_the_file(big_text, stdlib_cache):
    results = []
    for path in big_text:
        out = subprocess.run(
            [sys.executable, "-c", LOADER, str(path)], capture_output=True, text=True, timeout=300, check=True
        )
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    big, small = results
    assert big["pieces"] == small["pieces"] == 8  # one piece per stream: every stream has work
    # Reading the 220 MB file whole (as the old pipeline did) would add >= 200 MB over the 22 MB file.
    assert big["peak_rss_mb"] - small["peak_rss_mb"] < 40, results


RUN = [
    *rr.QUICK,
    "--data.num_streams=8",
    "--train.max_steps=30",
    "--checkpoint.every=5",
    "--eval.every=0",
    "--eval.batches=1",
    "--logging.wandb_mode=disabled",
]


def test_one_big_text_file_trains_and_resumes_bit_identically_after_kill_9(big_text, tmp_path, stdlib_cache):
    source = f"--data.train=[{{files: [{big_text[0]}]}}]"
    straight = rr.run(tmp_path / "straight", source, *RUN)
    size = f"{big_text[0].stat().st_size / 1e6:,.1f} MB"
    assert (
        f"[lmpretrain] data: files:{big_text[0]}: text, 1 file, {size}, one document per file; 8 pieces"
        in (straight.output)
    )
    out = tmp_path / "killed"
    proc = rr.start_forked(out, source, *RUN)
    rr.wait_for_step(proc, out, 12)
    rr.kill_tree(proc, signal.SIGKILL)
    proc.wait(timeout=120)
    killed_at = rr.read_metrics(out)[-1]["step"]
    assert killed_at < 30, "the run finished before it could be killed"
    resumed = rr.run(out, source, *RUN)
    assert f"resumed from {out / 'checkpoints' / f'step-{5 * (killed_at // 5):08d}'}" in resumed.output
    assert rr.file_sha256(straight.out / "final" / "model.safetensors") == rr.file_sha256(
        out / "final" / "model.safetensors"
    )
    assert straight.losses() == resumed.losses() and len(straight.losses()) == 30
    peak = max(r["perf/peak_mem_bytes"] for r in straight.metrics() if "perf/peak_mem_bytes" in r)
    assert peak < 1 << 30, f"peak RSS {peak / 2**30:.2f} GiB training on a {size} file"
