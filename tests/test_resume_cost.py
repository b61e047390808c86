"""A rank's resume cost does not grow with the world size: resolving and loading a checkpoint of 1,024 ranks
opens and stats the same files on a rank as one of 4 ranks does.

The checkpoint of W ranks is built here, not by W processes: a real save in one process, whose per-rank file
is then written for each of the W ranks (each with the data streams that rank owns) and whose meta.json and
manifest say W. Rank R of W is this process in torch's fake process group (collectives return without
talking to anyone). Opens are Python's audit events; stats are counted on os.stat, which every pathlib
check goes through. Rank 0 resolves (`resume=auto`, as at start-up and at each spike rollback) and loads; a
rank other than 0 checks the path rank 0 would broadcast and loads its states (on the fake group a broadcast
reaches no one, so the weights rank 0 broadcasts are not loaded there).
"""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
from data_helpers import make
from torch.testing._internal.distributed.fake_pg import FakeStore  # (importing it registers "fake")

from lmpretrain.checkpoint.checkpointer import MARKER_FILE, META_FILE, Checkpointer, PerRank, rank_file
from lmpretrain.data import SourceSpec, merge_data_states
from lmpretrain.run.rng import LoopRNG
from lmpretrain.run.train_state import TrainState

WORLDS = (4, 1024)
STEP_DIR = "step-00000003"


def stream(tok, corpus, rank: int, world: int, streams: int | None = None):
    # one stream per rank at every world size: the same work per rank
    n = streams or world
    return make(
        [SourceSpec(files=[str(corpus)])], tok, blocks_per_step=n, rank=rank, world_size=world, num_streams=n
    )


def build_checkpoint(out: Path, world: int, tok, corpus) -> Path:
    """A real one-process save, then its per-rank file written for each of `world` ranks."""
    model = torch.nn.Linear(4, 4)
    states = {
        "train": TrainState(step=3),
        "data": PerRank(stream(tok, corpus, 0, 1)),
        "rng": PerRank(LoopRNG(0)),
    }
    path = Checkpointer(out).save(
        3, model=model, optimizer=torch.optim.AdamW(model.parameters()), states=states
    )
    whole = torch.load(path / rank_file(0), weights_only=True)["states"]
    whole_data = stream(tok, corpus, 0, 1, streams=world).state_dict()  # all `world` streams' start positions
    for r in range(world):
        data = {**whole_data, "streams": {s: v for s, v in whole_data["streams"].items() if s % world == r}}
        torch.save(
            {"rank": r, "world_size": world, "states": {"data": data, "rng": whole["rng"]}},
            path / rank_file(r),
        )
    meta = json.loads((path / META_FILE).read_text())
    (path / META_FILE).write_text(json.dumps({**meta, "world_size": world}))
    manifest = {
        p.relative_to(path).as_posix(): p.stat().st_size
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != MARKER_FILE
    }
    (path / MARKER_FILE).write_text(json.dumps(manifest))
    return path


class FileOps:
    """The files a block of code opens (audit events) and stats (os.stat), by name relative to a root."""

    _active: list = []

    def __init__(self, root: Path, monkeypatch):
        self.root, self.opens, self.stats = str(root), [], []
        if not FileOps._active:  # an audit hook stays for the process's lifetime: add one, inert when idle
            sys.addaudithook(FileOps._hook)
            FileOps._active.append(None)
        real_stat = os.stat

        def counting_stat(p, *args, **kwargs):
            self._note(self.stats, p)
            return real_stat(p, *args, **kwargs)

        monkeypatch.setattr(os, "stat", counting_stat)
        FileOps._active[0] = self

    def _note(self, into, p) -> None:
        p = os.fspath(p) if isinstance(p, os.PathLike | str) else None
        if p is not None and p.startswith(self.root):
            into.append(os.path.relpath(p, self.root))

    @staticmethod
    def _hook(event, args):
        ops = FileOps._active[0] if FileOps._active else None
        if ops is not None and event in ("open", "os.listdir", "os.scandir") and args:
            ops._note(ops.opens, args[0])

    def stop(self):
        FileOps._active[0] = None


def fake_rank(rank: int, world: int):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    return SimpleNamespace(
        process_index=rank,
        num_processes=world,
        is_main_process=rank == 0,
        device=torch.device("cpu"),
        distributed_type=DistributedType.MULTI_CPU,
    )


def resume_as(rank: int, world: int, out: Path, tok, corpus, monkeypatch) -> tuple[FileOps, TrainState, dict]:
    state = fake_rank(rank, world)
    try:
        ck = Checkpointer(out, state)
        model, train, data = torch.nn.Linear(4, 4), TrainState(), stream(tok, corpus, rank, world)
        states = {
            "train": train,
            "data": PerRank(data, merge_data_states, data.saved_ranks),
            "rng": PerRank(LoopRNG(9)),
        }
        ops = FileOps(out, monkeypatch)
        try:
            if rank == 0:  # resolves, reads the weights and optimizer and broadcasts them
                path = ck.resolve_resume("auto", overwrite=False)
                ck.load(path, model=model, optimizer=torch.optim.AdamW(model.parameters()), states=states)
            else:  # given rank 0's path and weights on the real group: checks its files, loads its states
                path = out / "checkpoints" / STEP_DIR
                assert ck.files_problem(path) is None
                ck.load_states(path, states, ck.metadata(path))
        finally:
            ops.stop()
    finally:
        dist.destroy_process_group()
    return ops, train, data.state_dict()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, small_tokenizer):
    tok = small_tokenizer
    corpus = tmp_path_factory.mktemp("corpus") / "a.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(400)))
    root = tmp_path_factory.mktemp("ck")
    return tok, corpus, {w: build_checkpoint(root / f"world-{w}", w, tok, corpus).parents[1] for w in WORLDS}


@pytest.mark.parametrize("rank", [0, 3])
def test_a_rank_opens_and_stats_the_same_files_at_4_and_1024_ranks(checkpoints, rank, monkeypatch):
    tok, corpus, outs = checkpoints
    seen = {}
    for world in WORLDS:
        ops, train, position = resume_as(rank, world, outs[world], tok, corpus, monkeypatch)
        assert train.step == 3
        assert list(position["streams"]) == [rank]  # this rank's one stream, from its own file
        seen[world] = (sorted(ops.opens), sorted(ops.stats))
    assert seen[4] == seen[1024]
    opens, stats = seen[1024]
    step = f"checkpoints/{STEP_DIR}"
    assert {o for o in opens if o.endswith(".pt")} == {f"{step}/states.pt", f"{step}/{rank_file(rank)}"} | (
        {f"{step}/optimizer.pt"} if rank == 0 else set()
    )
    # the files a rank checks against the manifest: its own, and the shared ones on rank 0
    checked = {s for s in stats if s.endswith((".pt", ".safetensors"))}
    shared = {f"{step}/{n}" for n in ("states.pt", "optimizer.pt", "model.safetensors")}
    assert checked == {f"{step}/{rank_file(rank)}"} | (shared if rank == 0 else set())
    print(f"rank {rank}: {len(opens)} opens, {len(stats)} stats at 4 and at 1,024 ranks")
