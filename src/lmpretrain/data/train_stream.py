"""`TrainStream`: the blocks of every optimizer step from `num_streams` virtual streams, exactly resumable.

Global block j of a step comes from stream j % S; rank p owns streams s % world_size == p; worker w of a
rank owns the rank's streams [w::num_workers]. The blocks of a step therefore depend only on (data, seed,
blocks per step, S): world size and workers change who computes them, not what they are. The blocks per
step may vary with the step (a batch ramp, data/batch_ramp.py): step s takes `BatchRamp.blocks(s)`, and
the state counts the steps consumed, so a resumed stream knows the size of its next step. The training
mixture may change at resume (data/mixture.py).
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lmpretrain.config import data_problems
from lmpretrain.data import mixture
from lmpretrain.data.batch_ramp import BatchRamp
from lmpretrain.data.block_stream import BlockStream, StreamSettings
from lmpretrain.data.encoder import Encoder
from lmpretrain.data.global_shuffle import GlobalBlocksDataset, GlobalOrder, resolve_shuffle
from lmpretrain.data.sources import Source, open_sources
from lmpretrain.data.transforms import Transforms, load_transforms
from lmpretrain.errors import DataError, UserError

if TYPE_CHECKING:
    from lmpretrain.config import DataConfig

logger = logging.getLogger(__name__)

STATE_VERSION = 2  # 2: document windows, pieces of files, positions by byte offset / row group


@dataclass
class StepBlocks:
    input_ids: torch.Tensor  # [the step's blocks // world_size, seq_len], blocks ordered by stream id
    epoch: int  # min completed epochs of the first source over this rank's streams (as read so far)
    skipped_docs: int  # bad records skipped so far by this rank's streams
    sources: dict[str, int] = field(default_factory=dict)  # tokens each source gave this rank's blocks so far
    filtered_docs: int | None = None  # documents data.transforms dropped so far here (None: no transforms)


def step_counters(batch: StepBlocks) -> dict[str, tuple[int, str]]:
    """This rank's data counters of a step and how ranks combine them (name -> (value, "min" | "sum")):
    train/epoch (the least over every stream), train/skipped_docs, train/filtered_docs (with data.transforms)
    and data/<source>/tokens (sums). The recipe's train_step combines them in the step's one device read."""
    counters = {"train/epoch": (batch.epoch, "min"), "train/skipped_docs": (batch.skipped_docs, "sum")}
    if batch.filtered_docs is not None:
        counters["train/filtered_docs"] = (batch.filtered_docs, "sum")
    counters.update({f"data/{name}/tokens": (n, "sum") for name, n in batch.sources.items()})
    return counters


def blocks_per_stream(blocks_per_step: int, num_streams: int) -> list[int]:
    """c_s = G // S + (s < G % S): how many blocks stream s gives to every step."""
    return [blocks_per_step // num_streams + (s < blocks_per_step % num_streams) for s in range(num_streams)]


@dataclass(frozen=True)
class StepSizes:
    """Blocks each stream gives to step s (0-based), from step `first` on: what a dataset yields per item."""

    ramp: BatchRamp
    num_streams: int
    first: int = 0

    def counts(self, step: int) -> list[int]:
        return blocks_per_stream(self.ramp.blocks(step), self.num_streams)


def merge_data_states(per_rank_states: list[dict]) -> dict:
    """Merge the ranks' `state_dict()`s (each holds its own streams) into one any world size can load:
    `streams` by stream id; every other key must agree across ranks."""
    if not per_rank_states:
        raise DataError("no data states to merge")
    merged: dict = {}
    streams: dict[int, dict] = {}
    for rank, state in enumerate(per_rank_states):
        for key, value in state.items():
            if key == "streams":
                for sid, stream_state in value.items():
                    sid = int(sid)
                    if sid in streams and streams[sid] != stream_state:
                        raise DataError(
                            f"rank {rank} saved a different state for data stream {sid} than an earlier "
                            "rank; the checkpoint is inconsistent"
                        )
                    streams[sid] = copy.deepcopy(stream_state)
            elif key in merged and merged[key] != value:
                raise DataError(f"data state key {key!r} differs between ranks (rank {rank}: {value!r})")
            else:
                merged[key] = copy.deepcopy(value)
    merged["streams"] = dict(sorted(streams.items()))
    return merged


def _leave_signals_to_the_trainer(worker_id: int) -> None:
    """Schedulers signal every process of a job; a worker killed by SIGTERM/SIGINT would crash the
    trainer's step before it can save, so workers ignore both and stop when the trainer stops them."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _identity(item):
    return item


class _StreamsDataset(IterableDataset):
    """Yields one item per step for the streams it owns: ({stream: blocks}, {stream: state after them},
    {stream: (epoch, skipped)}, [bad-record reports]); in a worker, a UserError is yielded (the trainer
    raises it without a worker traceback) instead of raised."""

    def __init__(
        self,
        sources: list[Source],
        encoder: Encoder,
        settings: StreamSettings,
        streams: list[int],
        states: dict[int, dict],
        sizes: StepSizes,
        source_ids: list[int],
        transforms: Transforms | None = None,
    ):
        super().__init__()
        self.sources, self.encoder, self.settings = sources, encoder, settings
        self.streams, self.states, self.sizes = streams, states, sizes
        self.source_ids, self.transforms = source_ids, transforms
        self.block_streams: dict[int, BlockStream] = {}

    def __iter__(self):
        info = get_worker_info()
        mine = self.streams if info is None else self.streams[info.id :: info.num_workers]
        self.block_streams = {
            s: BlockStream(
                self.sources, self.encoder, self.settings, s, self.states[s], self.source_ids, self.transforms
            )
            for s in mine
        }
        try:
            for step in itertools.count(self.sizes.first):
                counts = self.sizes.counts(step)
                blocks = {
                    s: torch.from_numpy(b.next_blocks(counts[s])) for s, b in self.block_streams.items()
                }
                states = {s: b.state() for s, b in self.block_streams.items()}
                progress = {s: b.progress() for s, b in self.block_streams.items()}
                notes = [n for b in self.block_streams.values() for n in b.take_notes()]
                yield blocks, states, progress, notes
        except UserError as err:
            if info is None:
                raise
            yield err


def prepared_add_bos(add_bos: bool | None, sources: list[Source]) -> bool | None:
    """data.add_bos left null follows the token files the run trains on (a datatrove folder has no BOS
    unless its tokenizer's template adds one), so their framing is every source's and the held-out set's;
    token files that disagree need the setting stated. Without token files: the tokenizer decides."""
    if add_bos is not None:
        return add_bos
    found = {src.label: src.token_files.add_bos for src in sources if src.token_files is not None}
    if len(set(found.values())) > 1:
        listed = ", ".join(f"{label}: add_bos={value}" for label, value in found.items())
        raise DataError(
            f"the token sources were prepared with different add_bos ({listed}); set data.add_bos "
            "(sources prepared otherwise are then refused) or prepare them again alike"
        )
    return next(iter(found.values()), None)


class TrainStream:
    """Endless training blocks, one `StepBlocks` per optimizer step, for one rank; see the module docstring."""

    @classmethod
    def from_config(cls, cfg, tokenizer, ramp: BatchRamp, rank: int, world_size: int) -> TrainStream:
        """A run's stream on `rank` of `world_size`: cfg.data, the blocks `ramp` says, seeded by run.seed."""
        return cls(
            cfg.data, tokenizer, blocks_per_step=ramp, rank=rank, world_size=world_size, seed=cfg.run.seed
        )

    def __init__(
        self,
        data: DataConfig,
        tokenizer,
        *,
        blocks_per_step: int | BatchRamp,
        rank: int,
        world_size: int,
        seed: int,
    ):
        """`blocks_per_step`: the global blocks of every step, or a `BatchRamp` saying those of each step."""
        ramp = blocks_per_step if isinstance(blocks_per_step, BatchRamp) else BatchRamp(blocks_per_step)
        problems = data_problems(data, world_size) if world_size >= 1 else []
        if world_size < 1 or not 0 <= rank < world_size:
            problems.append(f"rank {rank} is not in [0, world_size={world_size})")
        else:
            for blocks in [size for _, size in ramp.stages] + [ramp.final]:
                if blocks < 1 or blocks % world_size:
                    problems.append(
                        f"blocks per step ({blocks}) must be a positive multiple of world_size ({world_size})"
                    )
        if problems:
            raise DataError("invalid data settings:\n  - " + "\n  - ".join(problems))
        self.encoder = Encoder(tokenizer, data.add_bos)  # checks EOS/BOS before reading any data
        self.transforms = load_transforms(data.transforms)  # a fork's document filters (data/transforms.py)
        self.sources = open_sources(
            data.train, tokenizer, self.transforms, data.max_open_files, data.tokenizer
        )
        prepared = prepared_add_bos(data.add_bos, self.sources)
        if prepared is not None and prepared != self.encoder.add_bos:  # unset, and the files frame otherwise
            self.encoder = Encoder(tokenizer, prepared)
        self.specs = [src.spec for src in self.sources]
        self.source_ids = list(range(len(self.sources)))  # seeds of their piece orders (data/mixture.py)
        self.source_names = mixture.metric_names(self.specs)
        self.tokenizer = tokenizer
        self.shuffle = resolve_shuffle(data.shuffle, self.sources)
        self.order = (
            GlobalOrder(self.sources, data.seq_len, seed, self.encoder.add_bos, data.epoch_offset)
            if self.shuffle == "global"
            else None
        )
        self.settings = StreamSettings(
            num_streams=data.num_streams,
            seq_len=data.seq_len,
            seed=seed,
            shuffle=self.shuffle == "windows",
            block_window=data.shuffle_window,
            doc_window=data.doc_shuffle_window,
        )
        self.num_streams, self.ramp, self.steps_done = data.num_streams, ramp, 0
        self.rank, self.world_size, self.num_workers = rank, world_size, data.num_workers
        self.owned = [s for s in range(self.num_streams) if s % world_size == rank]
        self.counts = blocks_per_stream(ramp.final, self.num_streams)  # of the steps after a ramp
        for src in self.sources if self.order is None else []:  # the global shuffle has no pieces
            n = len(src.pieces(self.num_streams))
            if n < self.num_streams:
                keep_every = -(-self.num_streams // n)
                logger.warning(
                    "[lmpretrain] WARNING: source %s has %d pieces for %d streams: streams share pieces and keep "
                    "every %d-th document, so each reads up to ~%dx the data it uses; give it more or bigger files",
                    src.label,
                    n,
                    self.num_streams,
                    keep_every,
                    keep_every,
                )
        if self.order is not None:
            initial = self.order.initial_state()
        else:
            initial = BlockStream.initial_state(len(self.sources))
        self._states: dict[int, dict] = {s: copy.deepcopy(initial) for s in self.owned}
        self._reported: set[str] = set()
        self._loader_iter = None
        self._dataset: _StreamsDataset | None = None

    def describe(self) -> str:
        """One line on what is read and how, for the start-up log."""
        s = self.settings
        sources = "; ".join(src.summary(s.num_streams) for src in self.sources)
        shuffle = {
            "global": "shuffle: global, a seeded permutation of every block of the corpus per epoch"
            + (", a seeded grid offset per epoch" if self.order and self.order.epoch_offset else ""),
            "windows": f"shuffle: windows, piece order per epoch, {s.doc_window}-document windows, "
            f"{s.block_window}-block windows",
            "none": "no shuffle",
        }[self.shuffle]
        transforms = f"{self.transforms.describe()} (text sources); " if self.transforms else ""
        return (
            f"data: {sources}; {transforms}{self.encoder.describe()}; {s.num_streams} streams x {s.seq_len}-token "
            f"blocks, {self.ramp.describe()}; {shuffle}"
        )

    def __iter__(self) -> Iterator[StepBlocks]:
        """Start (or restart) from the current state: the last consumed step, or what `load_state_dict` set."""
        self.close()
        sizes = StepSizes(self.ramp, self.num_streams, self.steps_done)
        if self.order is not None:  # every stream holds the same position: the step's
            state = copy.deepcopy(self._states[self.owned[0]])
            self._dataset = GlobalBlocksDataset(self.order, self.owned, state, sizes)
        else:
            self._dataset = _StreamsDataset(
                self.sources,
                self.encoder,
                self.settings,
                self.owned,
                copy.deepcopy(self._states),
                sizes,
                self.source_ids,
                self.transforms,
            )
        if self.num_workers == 0:
            items = iter(self._dataset)
        else:
            # Forked workers would otherwise warn and disable the tokenizer's threads one by one.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            # Own generator: creating the workers must not draw from the global torch RNG (resume exactness).
            loader = DataLoader(
                self._dataset,
                batch_size=None,
                num_workers=self.num_workers,
                collate_fn=_identity,
                prefetch_factor=2,
                worker_init_fn=_leave_signals_to_the_trainer,
                generator=torch.Generator().manual_seed(self.settings.seed),
            )
            items = self._loader_iter = iter(loader)
        return self._steps(items)

    def start(self) -> Iterator[StepBlocks]:
        """`iter(self)` with the first step's blocks already read, so that a restored position that no
        longer fits the data fails now, before a resumed run writes anything, not at its first step."""
        steps = iter(self)
        return itertools.chain([next(steps)], steps)

    def _steps(self, items) -> Iterator[StepBlocks]:
        # DataLoader takes items round-robin from workers, and each worker yields one item per step.
        per_step = max(1, self.num_workers)
        while True:
            blocks, states, progress = {}, {}, {}
            for _ in range(per_step):
                item = next(items)
                if isinstance(item, UserError):
                    raise item
                chunk, state, counts, notes = item
                blocks.update(chunk)
                states.update(state)
                progress.update(counts)
                for label, report in notes:
                    if label not in self._reported:
                        self._reported.add(label)
                        logger.warning(report)
            ids = torch.cat([blocks[s] for s in self.owned]).long()
            self._states.update(states)  # only now is this step consumed
            self.steps_done += 1
            tokens = [sum(per_source) for per_source in zip(*(p[2] for p in progress.values()), strict=True)]
            yield StepBlocks(
                ids,
                epoch=min(p[0] for p in progress.values()),
                skipped_docs=sum(p[1] for p in progress.values()),
                sources=dict(zip(self.source_names, tokens, strict=True)),
                # (the global shuffle reads token files, which no transform touches: 3-tuples)
                filtered_docs=sum(p[3] for p in progress.values() if len(p) > 3) if self.transforms else None,
            )

    def state_dict(self) -> dict:
        """Position of what was consumed: {"version", "num_streams", "steps", "mixture", "streams": {stream id:
        plain dict}}; `mixture` names the sources the positions belong to (data/mixture.py)."""
        return {
            "version": STATE_VERSION,
            "num_streams": self.num_streams,
            "steps": self.steps_done,
            "mixture": mixture.mixture(self.specs, self.source_ids),
            **({"transforms": self.transforms.fingerprint()} if self.transforms else {}),
            "streams": copy.deepcopy(self._states),
        }

    def saved_ranks(self, saved_world_size: int) -> list[int]:
        """The ranks of a run of ``saved_world_size`` processes whose states hold this rank's streams (stream
        s was owned by rank s mod that world size): all this rank's load needs, the same number of ranks
        whatever the world size (its own alone when the world size is unchanged)."""
        return sorted({s % saved_world_size for s in self.owned})

    def load_state_dict(self, state: dict) -> None:
        """Take this rank's streams from a state holding (at least) them, e.g. all ranks' merged states. When
        its mixture differs from this run's (weights, sources added or removed; the recipe allows that only
        with run.allow_data_change), each stream restarts at its frontier (data/mixture.py)."""
        if state.get("version") != STATE_VERSION:
            raise DataError(
                f"the data state has version {state.get('version')}, this lmpretrain reads version {STATE_VERSION} "
                "(the data pipeline changed); start the run fresh (--run.resume=never) in another output_dir"
            )
        if state.get("num_streams") != self.num_streams:
            raise DataError(
                f"data state was saved with data.num_streams={state.get('num_streams')}, this run has "
                f"{self.num_streams}; the stream layout must stay the same to resume"
            )
        streams = {int(k): v for k, v in state["streams"].items()}
        missing = [s for s in self.owned if s not in streams]
        if missing:
            raise DataError(
                f"data state lacks streams {missing[:8]} owned by rank {self.rank}; pass the merged "
                "states of all ranks (merge_data_states)"
            )
        self.close()
        self._states = {s: copy.deepcopy(streams[s]) for s in self.owned}
        self.steps_done = state.get("steps", 0)  # (states written before ramps: only constant batches)
        if "mixture" in state:  # (states written before mixtures could change have the same sources)
            self.source_ids, changed = mixture.follow(state["mixture"], self.specs)
            # Other transforms (run.allow_data_change): the documents read since the frontier were transformed
            # the old way, so every stream goes on from its frontier like at a mixture change.
            changed |= state.get("transforms", []) != self.transforms.fingerprint()
            if self.order is not None:
                self.order.set_source_ids(self.source_ids)
            if changed:
                keys = mixture.source_keys(self.specs)
                self._states = {
                    s: mixture.restart_at_frontier(st, state["mixture"], keys)
                    for s, st in self._states.items()
                }

    @property
    def add_bos(self) -> bool:
        """Whether documents start with BOS, as the run frames them (data.add_bos, or its token files')."""
        return self.encoder.add_bos

    def fingerprint(self) -> dict:
        """What the stream depends on. world_size and num_workers are informational: resuming across them is exact."""
        from lmpretrain.data.tokenizer import tokenizer_hash

        s = self.settings
        # Only the global shuffle has epoch offsets (so text runs' fingerprints stay as they were).
        offsets = {"epoch_offset": self.order.epoch_offset} if self.order is not None else {}
        return {
            **offsets,
            "sources": [src.fingerprint() for src in self.sources],
            "tokenizer": tokenizer_hash(self.tokenizer),
            "add_bos": self.encoder.add_bos,
            "seq_len": s.seq_len,
            "num_streams": s.num_streams,
            "seed": s.seed,
            "shuffle": self.shuffle,
            "shuffle_window": s.block_window,
            "doc_shuffle_window": s.doc_window,
            "data_version": STATE_VERSION,
            **({"transforms": self.transforms.fingerprint()} if self.transforms else {}),
            "world_size": self.world_size,
            "num_workers": self.num_workers,
        }

    def records_read(self) -> int:
        """Records this rank's in-process streams pulled from the sources (num_workers=0 only; for tests)."""
        if self.num_workers:
            raise RuntimeError("records_read is only tracked with num_workers=0")
        return sum(b.records_read for b in self._dataset.block_streams.values()) if self._dataset else 0

    def __enter__(self) -> TrainStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the dataloader workers, if any, and close in-process readers."""
        it, self._loader_iter = self._loader_iter, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        if self._dataset is not None:
            for block_stream in self._dataset.block_streams.values():
                block_stream.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
