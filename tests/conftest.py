"""Shared pytest fixtures."""

from __future__ import annotations

import functools
import json
import random
import subprocess
from pathlib import Path

import pytest

# ---- data fixtures (tiny corpora, a small tokenizer, an isolated corpus cache) ---------------------------

_WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
    "upsilon phi chi psi omega def return class import for while if else None True False"
).split()


def make_doc(tag: str, rng: random.Random, max_words: int = 60) -> str:
    """A document that names itself (`tag`) so tests can recognise it after tokenization."""
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, max_words)))
    return f"<{tag}> {words}\n"


def write_jsonl_shards(
    folder,
    docs_per_shard: list[int],
    *,
    prefix: str = "shard",
    seed: int = 0,
    field: str = "text",
    max_words: int = 60,
) -> list[str]:
    """JSONL shards with `docs_per_shard[i]` documents each; returns the file paths."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, n in enumerate(docs_per_shard):
        path = folder / f"{prefix}-{i:03d}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for k in range(n):
                f.write(json.dumps({field: make_doc(f"{prefix}{i}.{k}", rng, max_words), "id": k}) + "\n")
        paths.append(str(path))
    return paths


@pytest.fixture(scope="session")
def small_tokenizer(tmp_path_factory):
    """A real byte-level BPE (vocab 320) trained once per session on text like the tiny corpora."""
    from lmpretrain.data.tokenizer import train_bpe

    rng = random.Random(123)
    texts = [make_doc(f"shard{i % 7}.{i}", rng) for i in range(400)]
    return train_bpe(texts, vocab_size=320, out_dir=tmp_path_factory.mktemp("small_tokenizer"))


@pytest.fixture(scope="session")
def stdlib_cache():
    """The default corpus and builtin tokenizer in the normal cache, built once (the recipe runs in the
    end-to-end tests use the same cache, so the suite builds them once)."""
    from lmpretrain.data import corpus
    from lmpretrain.data.tokenizer import ensure_builtin_tokenizer

    corpus.ensure_stdlib_corpus()
    ensure_builtin_tokenizer()
    return corpus.cache_root()


# ---- tiny models ---------------------------------------------------------------------------------------------


def one_layer_llama_config(vocab_size: int, **overrides):
    """The smallest real Llama config the unit tests train (one layer, 16 wide)."""
    from transformers import AutoConfig

    shape = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    return AutoConfig.for_model("llama", vocab_size=vocab_size, **{**shape, **overrides})


def tiny_llama(seed: int, **overrides):
    """A Llama initialised from torch seed `seed`, in train mode: 2 layers 32 wide, 4 heads over 2 KV heads,
    vocab 97, 32 positions, tied embeddings; `overrides` change the config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    shape = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(LlamaConfig(**{**shape, **overrides})).train()


# A one-layer Mixtral small enough for float64 reference steps: 3 experts, 2 per token (tests/test_muon.py,
# and the Muon spread runs' tests/muon_spread_models.py)
TINY_MIXTRAL = {
    "hidden_size": 32,
    "intermediate_size": 24,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 3,
    "num_experts_per_tok": 2,
}


# ---- runs shared by several test modules -------------------------------------------------------------------


@pytest.fixture(scope="session")
def two_ranks_accum2(tmp_path_factory):
    """DDP: 2 gloo ranks x micro-batch 2 x accumulation 2 (global batch 8), float64, 10 steps."""
    import recipe_runner as rr

    return rr.run(
        tmp_path_factory.mktemp("ddp") / "run",
        *rr.EXACT,
        "--train.micro_batch_size=2",
        "--train.grad_accum_steps=2",
        launch="cpu-ddp",
    )


@pytest.fixture
def one_thread():
    """Tiny shapes gain nothing from a second thread, and on a busy machine its barriers cost seconds
    (modules that want it: pytestmark = pytest.mark.usefixtures("one_thread"))."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- pytest-xdist (make test: -n 2 --dist loadfile, so a module's shared runs are made once) ------------

# Runs whose assertions compare two measurements taken at different moments (the smoke run checks
# perf/mfu < 1: tokens/s against the peak FLOP/s it measured at start-up), so another worker's burst
# between the two would skew them: under xdist they run while no other test does.
_ALONE_FIXTURES = {"smoke"}


class _WorkerLock:
    """Across xdist workers: every test holds a shared lock, an _ALONE_FIXTURES setup the exclusive one.
    A turnstile file keeps new shared holders out while an exclusive one waits (no starvation)."""

    def __init__(self, folder):
        self.main = open(folder / "workers.lock", "a+")  # noqa: SIM115 - held for the whole session
        self.turnstile = open(folder / "workers.turnstile", "a+")  # noqa: SIM115

    def shared(self) -> None:
        import fcntl

        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        fcntl.flock(self.main, fcntl.LOCK_SH)
        fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    def exclusive(self) -> None:
        """From shared to exclusive, waiting for the other workers' current tests to end."""
        import fcntl

        fcntl.flock(self.main, fcntl.LOCK_UN)  # first: holding it while waiting could deadlock
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        fcntl.flock(self.main, fcntl.LOCK_EX)
        fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    def downgrade(self) -> None:
        """Back to shared, without the turnstile (a waiting worker may hold it)."""
        import fcntl

        fcntl.flock(self.main, fcntl.LOCK_SH)

    def unlock(self) -> None:
        import fcntl

        fcntl.flock(self.main, fcntl.LOCK_UN)


def _worker_lock(config) -> _WorkerLock | None:
    """This worker's handle on the lock, in the folder all workers' temporary folders share (this run's)."""
    import os

    global _LOCK
    if os.environ.get("PYTEST_XDIST_WORKER") and _LOCK is None:
        _LOCK = _WorkerLock(config._tmp_path_factory.getbasetemp().parent)
    return _LOCK


_LOCK = None


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    lock = _worker_lock(request.config) if fixturedef.argname in _ALONE_FIXTURES else None
    if lock is None:
        yield
        return
    lock.exclusive()
    try:
        yield
    finally:
        lock.downgrade()


# ---- tests marked slurm: a real SLURM (make slurm-cluster) ----------------------------------------------


@functools.cache
def slurm_problem() -> str | None:
    """Why no SLURM job can run here (None: sinfo answers and a node is up)."""
    try:
        out = subprocess.run(
            ["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"sinfo does not answer ({err})"
    if out.returncode != 0:
        return f"sinfo does not answer ({out.stderr.strip()[-300:]})"
    if not {"idle", "mixed", "allocated", "completing"} & set(out.stdout.split()):
        return f"no SLURM node is up (sinfo: {out.stdout.split()})"
    return None


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures submit anything
def pytest_runtest_setup(item):
    import os

    if item.get_closest_marker("slurm") and (problem := slurm_problem()):
        message = f"{problem}: make slurm-cluster starts a single-node SLURM here"
        if os.environ.get("LMPRETRAIN_REQUIRE_SLURM") == "1":  # CI (.ci/run): a skip must not hide it
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


# ---- longest files first (make test: --dist loadfile --no-loadscope-reorder) ----------------------------------

# tests/durations.jsonl is a CPU log of a whole suite (make test-durations). xdist hands a file to whichever
# worker is free, in collection order; by default it orders files by their number of tests, which leaves
# the few-test end-to-end files (minutes each) for the end, one worker busy and the other idle. Longest
# first, the last files handed out are the short ones. Tests the log does not know count as a typical
# test of their lane.
DURATIONS = Path(__file__).with_name("durations.jsonl")
_UNKNOWN_S = {True: 20.0, False: 0.5}  # slow, not slow


@pytest.hookimpl(trylast=True)  # after -m / -k deselection: only the tests that will run count
def pytest_collection_modifyitems(config, items):
    if not DURATIONS.exists():
        return
    known = {}
    for line in DURATIONS.read_text().splitlines():
        row = json.loads(line)
        known[row["test"]] = row["cpu_s"]
    per_file: dict[str, float] = {}
    for item in items:
        seconds = known.get(item.nodeid, _UNKNOWN_S[item.get_closest_marker("slow") is not None])
        per_file[item.location[0]] = per_file.get(item.location[0], 0.0) + seconds
    items.sort(key=lambda item: -per_file[item.location[0]])  # stable: a file's tests stay in order


# ---- per-test CPU time (LMPRETRAIN_TEST_CPU_LOG=path): load-insensitive suite timing -------------------------


def _cpu_seconds() -> float:
    import resource
    import sys

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    runner = sys.modules.get("recipe_runner")  # runs forked from its fork server are not our children
    forked = runner.FORKED_CPU_S if runner else 0.0
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forked


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, hold the workers' shared lock (see _WorkerLock). With LMPRETRAIN_TEST_CPU_LOG set,
    append one JSON line per test: its CPU seconds (this process and every child process it waited for,
    setup and teardown included) and its wall seconds. On a shared machine wall times swell with the
    load; CPU time does not, and on idle cores wall ~ CPU / cores used."""
    import os
    import time

    lock = _worker_lock(item.config)
    if lock is not None:
        lock.shared()
    path = os.environ.get("LMPRETRAIN_TEST_CPU_LOG")
    cpu, wall = _cpu_seconds(), time.monotonic()
    try:
        yield
    finally:
        if lock is not None:
            lock.unlock()
    if not path:
        return
    row = {
        "test": item.nodeid,
        "cpu_s": round(_cpu_seconds() - cpu, 2),
        "wall_s": round(time.monotonic() - wall, 2),
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
