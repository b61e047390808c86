"""Byte-level BPE and character-level training, saving, loading; the builtin tokenizers; clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lmpretrain.data.tokenizer import load_tokenizer, tokenizer_hash, train_bpe, train_char_level
from lmpretrain.errors import TokenizerError

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "train_tokenizer.py")
TEXT = "def add(a, b):\n    return a + b  # sum, naïve ünïcode ✓\n"


def test_train_bpe_saves_a_tokenizer_autotokenizer_loads(tmp_path):
    train_bpe([TEXT * 3, "import os\nprint(os.getcwd())\n"] * 20, vocab_size=300, out_dir=tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    ids = tok(TEXT)["input_ids"]
    assert tok.decode(ids) == TEXT  # byte level: every character round-trips, no prefix space
    assert 0 not in ids and 1 not in ids  # no BOS/EOS added automatically


def test_train_char_level_keeps_the_most_frequent_characters(tmp_path):
    texts = ["aaaa bbbbb cc D", "Aa b cd\né"]  # lowercased: a 6, b 6 - 1, space 4, c 3, d 2, newline 1, é 1
    train_char_level(texts, vocab_size=9, out_dir=tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert len(tok) == 9
    assert [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id] == [0, 1, 2, 3]
    assert {c: tok.get_vocab()[c] for c in "ab cd"} == {
        "a": 4,
        "b": 5,
        " ": 6,
        "c": 7,
        "d": 8,
    }  # by frequency
    ids = tok("Ab c\té", add_special_tokens=False)["input_ids"]
    assert ids == [4, 5, 6, 7, 3, 3]  # one token per character, lowercased; tab and é did not fit: unknown
    assert tok.decode(tok("cab ba", add_special_tokens=False)["input_ids"]) == "cab ba"  # no spaces added


def test_builtin_tokenizer_round_trips_and_has_special_tokens(stdlib_cache):
    tok = load_tokenizer("builtin:python-stdlib")
    assert len(tok) == 8192
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == TEXT
    code = "def __init__(self, name):\n    self.name = name\n    return None\n"
    assert len(tok(code)["input_ids"]) < len(code) / 3  # it learned Python
    assert tokenizer_hash(tok) == tokenizer_hash(load_tokenizer("builtin:python-stdlib"))


def test_load_tokenizer_errors_name_the_spec(tmp_path, small_tokenizer):
    with pytest.raises(
        TokenizerError, match="unknown builtin tokenizer 'builtin:nope'|unknown builtin tokenizer 'nope'"
    ):
        load_tokenizer("builtin:nope")
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))
    PreTrainedTokenizerFast(tokenizer_object=small_tokenizer.backend_tokenizer).save_pretrained(
        tmp_path / "no_eos"
    )
    with pytest.raises(TokenizerError, match="has no EOS token"):
        load_tokenizer(str(tmp_path / "no_eos"))
    code = (
        "from lmpretrain.data.tokenizer import load_tokenizer\ntry:\n    load_tokenizer('no-such-org/no-such-tok')\n"
        "except Exception as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    ).stdout
    assert "'no-such-org/no-such-tok' is neither a local folder (there is no directory" in out
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="folder '.*empty' holds no loadable tokenizer"):
        load_tokenizer(str(tmp_path / "empty"))


def test_train_tokenizer_script_on_local_files(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT * 50)
    (tmp_path / "b.jsonl").write_text('{"body": "import os"}\n' * 30)
    out = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--files",
            str(tmp_path / "a.txt"),
            "--vocab-size",
            "300",
            "--out",
            str(tmp_path / "tok"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "vocab size 2" in out.stdout and "decodes back: True" in out.stdout  # a tiny corpus: <= 300 tokens
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert tok.decode(tok(TEXT)["input_ids"]) == TEXT
    out = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--files",
            str(tmp_path / "b.jsonl"),
            "--text-field",
            "nope",
            "--vocab-size",
            "300",
            "--out",
            str(tmp_path / "t2"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "no field 'nope'" in out.stderr
