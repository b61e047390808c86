"""The held-out set from few documents: one plain text file is shared out as windows spread through it."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lmpretrain.config import DataConfig
from lmpretrain.data import SourceSpec, heldout_blocks
from lmpretrain.errors import DataError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda def return class import".split()


def write_text(path, n_bytes: int, seed: int = 0) -> str:
    """ASCII prose with numbered lines (each window of it is found in the file exactly once)."""
    rng = random.Random(seed)
    lines, size = [], 0
    while size < n_bytes:
        line = f"{len(lines)} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + "\n"
        lines.append(line)
        size += len(line)
    path.write_text("".join(lines))
    return path.read_text()


def test_one_300kb_text_file_gives_windows_spread_through_it(tmp_path, small_tokenizer):
    text = write_text(tmp_path / "val.txt", 300_000)
    data = DataConfig(eval=[SourceSpec(files=[str(tmp_path / "val.txt")])], seq_len=64)
    blocks = heldout_blocks(data, small_tokenizer, num_blocks=16)  # eval.batches 2 x eval.batch_size 8
    assert blocks.shape == (16, 64)
    bos, eos = small_tokenizer.bos_token_id, small_tokenizer.eos_token_id
    rows = blocks.tolist()
    assert rows[0][0] == bos and rows[-1][-1] == eos  # the file's start and its end
    assert sum(r.count(bos) + r.count(eos) for r in rows) == 2
    # Every block is one window of the file; the windows are spread evenly from its start to its end.
    starts = []
    for row in rows:
        piece = small_tokenizer.decode([t for t in row if t not in (bos, eos)])
        assert text.count(piece) == 1
        starts.append(text.index(piece))
    assert starts[0] == 0 and starts[-1] + len(piece) == len(text)
    gaps = np.diff(starts)
    assert (gaps > 0).all() and gaps.max() < 1.2 * gaps.min()
    assert heldout_blocks(data, small_tokenizer, num_blocks=16).equal(blocks)


def test_few_documents_each_give_an_equal_share(tmp_path, small_tokenizer):
    write_text(tmp_path / "a.txt", 400)  # shorter than its share: all of it
    write_text(tmp_path / "b.txt", 60_000, seed=1)
    data = DataConfig(eval=[SourceSpec(files=[str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])], seq_len=32)
    flat = heldout_blocks(data, small_tokenizer, num_blocks=32).flatten().tolist()
    eos = small_tokenizer.eos_token_id
    short = flat.index(eos) + 1  # a.txt whole, then windows of b.txt up to the end of the set
    assert short < 1024 // 2 and flat[short] == small_tokenizer.bos_token_id and flat[-1] == eos


def test_a_too_small_held_out_set_says_what_it_holds(tmp_path, small_tokenizer):
    write_text(tmp_path / "val.txt", 2_000)
    data = DataConfig(eval=[SourceSpec(files=[str(tmp_path / "val.txt")])], seq_len=64)
    with pytest.raises(DataError) as err:
        heldout_blocks(data, small_tokenizer, num_blocks=16)
    message = str(err.value)
    held = int(message.split(" hold ")[1].split(" tokens")[0].replace(",", ""))
    assert 300 < held < 1024
    assert "in 1 document(s), all of them read whole (nothing capped)" in message
    assert "16 blocks x 64 = 1,024 tokens" in message and "lower eval.batches or eval.batch_size" in message
