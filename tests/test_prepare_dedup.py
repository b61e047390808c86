"""scripts/prepare_data.py --dedup: datatrove's exact and minhash deduplication before tokenizing, the documents
removed in the header and on screen, the first copy kept whatever the task count, and datatrove's log lines
kept off the terminal."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from lmpretrain.config import SourceSpec
from lmpretrain.data.encoder import Encoder
from lmpretrain.data.prepare import write_token_files
from lmpretrain.data.token_layouts import HEADER
from lmpretrain.errors import DataError

PREPARE = Path(__file__).resolve().parents[1] / "scripts" / "prepare_data.py"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def text(i: int, words: int = 40) -> str:
    """Document i: words that no other document shares in the same order."""
    return f"doc{i} " + " ".join(WORDS[(i * 7 + k * (i % 5 + 1)) % len(WORDS)] for k in range(words))


def write(path: Path, docs: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def documents(folder: Path, tok) -> list[str]:
    """The token files' documents, decoded, in order."""
    header = json.loads((folder / HEADER).read_text())
    out = []
    for shard in header["shards"]:
        ids = np.fromfile(folder / f"{shard['name']}.bin", dtype=header["dtype"])
        starts = np.fromfile(folder / f"{shard['name']}.idx", dtype="<u8")
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            doc = ids[a:b].tolist()
            out.append(tok.decode(doc[int(header["add_bos"]) : -1]))
    return out


@pytest.fixture
def copies(tmp_path):
    """Three files, 42 documents: 30 distinct; 12 of them appear again (4 in the same file, 8 in later files)."""
    a = [text(i) for i in range(12)] + [text(0), text(1), text(2), text(3)]
    b = [text(i) for i in range(12, 22)] + [text(4), text(5), text(6), text(7)]
    c = [text(i) for i in range(22, 30)] + [text(8), text(9), text(10), text(11)]
    return [write(tmp_path / f"{n}.jsonl", docs) for n, docs in (("a", a), ("b", b), ("c", c))]


def test_exact_dedup_removes_every_later_copy_and_writes_the_same_bytes_for_any_task_count(
    copies, small_tokenizer, tmp_path
):
    one = write_token_files(SourceSpec(files=copies), small_tokenizer, tmp_path / "one", dedup="exact")
    assert one["dedup"] == {"method": "exact", "documents": 42, "removed": 12} and one["documents"] == 30
    kept = documents(tmp_path / "one", small_tokenizer)
    assert sorted(kept) == sorted(text(i) for i in range(30))
    assert kept[:12] == [text(i) for i in range(12)]  # the first copy, in source order
    three = write_token_files(
        SourceSpec(files=copies), small_tokenizer, tmp_path / "three", tasks=3, dedup="exact"
    )
    for name in [s["name"] for s in one["shards"]]:
        for ext in (".bin", ".idx"):
            assert (tmp_path / "one" / f"{name}{ext}").read_bytes() == (
                tmp_path / "three" / f"{name}{ext}"
            ).read_bytes()
    assert three["dedup"] == one["dedup"]


def test_minhash_dedup_removes_near_copies_and_keeps_distinct_documents(tmp_path, small_tokenizer):
    import random

    def words(r):  # letters only: minhash's text normalisation turns every digit into 0
        return " ".join("".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5)) for _ in range(80))

    docs = [words(random.Random(i)) for i in range(20)]
    near = [d.replace(d.split()[40], "CHANGED", 1) + " coda" for d in docs[:6]]  # a word changed, one added
    path = write(tmp_path / "near.jsonl", docs + near)
    header = write_token_files(SourceSpec(files=[path]), small_tokenizer, tmp_path / "tok", dedup="minhash")
    assert (
        header["dedup"] == {"method": "minhash", "documents": 26, "removed": 6} and header["documents"] == 20
    )
    exact = write_token_files(SourceSpec(files=[path]), small_tokenizer, tmp_path / "exact", dedup="exact")
    assert exact["dedup"]["removed"] == 0  # no exact copies among them


def test_the_script_reports_what_it_removed_and_shows_no_datatrove_log_lines(
    copies, small_tokenizer, tmp_path, capfd, monkeypatch
):
    monkeypatch.delenv("CI", raising=False)  # our bars are off under CI=true (as in .ci/run): drawn here
    monkeypatch.delenv("RANK", raising=False)
    spec = importlib.util.spec_from_file_location("prepare_data", PREPARE)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    small_tokenizer.save_pretrained(tmp_path / "tok")
    filters = tmp_path / "filters.py"
    filters.write_text("def no_doc5(text, source):\n    return None if text.startswith('doc5 ') else text\n")
    argv = ["--tokenizer", str(tmp_path / "tok"), "--tasks", "2", "--dedup", "exact"]
    argv += ["--transform", f"{filters}:no_doc5", *(f"--files={f}" for f in copies)]
    assert script.main([*argv, "--out", str(tmp_path / "out")]) == 0
    out, err = capfd.readouterr()
    assert "--transform dropped 2 documents" in out  # doc5 and its copy, before the dedup saw them
    assert "--dedup exact removed 11 of 40 documents" in out
    assert "| INFO" not in err and "Launching pipeline" not in err and "PIPELINE" not in err
    # nor datatrove's own bars inside the dedup tasks (tqdm's default unit, it/s): only ours, by stage
    assert "Initializing pq" not in err and "it/s]" not in err and "\x1b[A" not in err, err
    lines = err.replace("\r", "\n").splitlines()
    bars = {line.split(":")[1].strip() for line in lines if line.startswith("out: ")}
    assert bars == {"dedup signatures", "dedup find", "tokenize"}, bars  # the filter: in front of the writer
    header = json.loads((tmp_path / "out" / HEADER).read_text())
    assert header["transforms"][0]["name"] == f"{filters}:no_doc5" and header["filtered"] == 2
    assert Encoder(small_tokenizer, None).add_bos == header["add_bos"]


def test_an_unknown_dedup_method_and_a_stateful_transform_are_refused(copies, small_tokenizer, tmp_path):
    from lmpretrain.data.transforms import load_transforms

    with pytest.raises(DataError, match=r"--dedup 'fuzzy' is not one of \('exact', 'minhash'\)"):
        write_token_files(SourceSpec(files=copies), small_tokenizer, tmp_path / "x", dedup="fuzzy")
    dedup = load_transforms(["examples/data_transforms.py:ExactDedup"])
    with pytest.raises(DataError, match="deduplicate with --dedup exact or --dedup minhash"):
        write_token_files(SourceSpec(files=copies), small_tokenizer, tmp_path / "x", transforms=dedup)
    assert not (tmp_path / "x").exists()
