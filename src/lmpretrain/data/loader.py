"""`TrainStream`: the rows of every optimizer step from `num_streams` virtual streams, exactly resumable.

Global row j of a step comes from stream j % S; rank p owns streams s % world_size == p; worker w of a
rank owns the rank's streams [w::num_workers]. The rows of a step therefore depend only on (data,
seed, rows_per_step, S): world size and workers change who computes them, not what they are.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lmpretrain.data.sources import Source, SourceSpec, as_spec, open_source, read_tokens_meta
from lmpretrain.data.stream import Encoder, StreamReader, shard_plan
from lmpretrain.errors import DataError

logger = logging.getLogger(__name__)

STATE_VERSION = 1


@dataclass
class StepRows:
    input_ids: torch.Tensor  # [rows_per_step // world_size, seq_len], rows ordered by stream id then position
    epoch: int  # min completed epochs of the first source over this rank's streams
    skipped_docs: int  # cumulative bad records skipped by this rank's streams


def rows_per_stream(rows_per_step: int, num_streams: int) -> list[int]:
    """c_s = G // S + (s < G % S): how many rows stream s gives to every step."""
    return [rows_per_step // num_streams + (s < rows_per_step % num_streams) for s in range(num_streams)]


def _leave_signals_to_the_trainer(worker_id: int) -> None:
    """Schedulers signal every process of a job; a worker killed by SIGTERM/SIGINT would crash the
    trainer's step before it can save, so workers ignore both and stop when the trainer stops them."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _identity(item):
    return item


def _open_all(sources: list[SourceSpec | dict], tokenizer) -> tuple[list[SourceSpec], list[Source], Encoder]:
    if not sources:
        raise DataError("no data sources given (data.train or data.eval is empty)")
    specs = [as_spec(s) for s in sources]
    encoder = Encoder(tokenizer)  # checks EOS before reading any data
    opened = [open_source(s) for s in specs]
    for src in opened:
        meta = read_tokens_meta(src) if src.tokens else None
        if meta is not None:
            from lmpretrain.tokenizer import tokenizer_hash

            if meta.get("tokenizer_hash") != tokenizer_hash(tokenizer):
                raise DataError(
                    f"source {src.label} was pre-tokenized with another tokenizer "
                    f"({meta.get('tokenizer')!r}); re-run scripts/prepare_data.py with this one"
                )
    return specs, opened, encoder


class _StreamsDataset(IterableDataset):
    """Yields one item per step: ({stream: rows}, {stream: state after those rows}) for the streams it owns."""

    def __init__(
        self, sources, encoder, streams, states, counts, *, seq_len, num_streams, seed, shuffle, window
    ):
        super().__init__()
        self.sources, self.encoder, self.streams, self.states, self.counts = (
            sources,
            encoder,
            streams,
            states,
            counts,
        )
        self.kw = dict(num_streams=num_streams, seq_len=seq_len, seed=seed, shuffle=shuffle, window=window)
        self.readers: dict[int, StreamReader] = {}

    def __iter__(self):
        info = get_worker_info()
        mine = self.streams if info is None else self.streams[info.id :: info.num_workers]
        self.readers = {
            s: StreamReader(self.sources, self.encoder, stream=s, state=self.states[s], **self.kw)
            for s in mine
        }
        while True:
            chunks = {s: torch.from_numpy(r.next_blocks(self.counts[s])) for s, r in self.readers.items()}
            yield chunks, {s: r.state() for s, r in self.readers.items()}


class TrainStream:
    """Endless training rows, one `StepRows` per optimizer step, for one rank; see the module docstring."""

    def __init__(
        self,
        sources: list[SourceSpec],
        tokenizer,
        *,
        seq_len: int,
        num_streams: int,
        rows_per_step: int,
        rank: int,
        world_size: int,
        num_workers: int,
        seed: int,
        shuffle: bool = True,
        shuffle_window: int = 64,
    ):
        problems = []
        if world_size < 1 or not 0 <= rank < world_size:
            problems.append(f"rank {rank} is not in [0, world_size={world_size})")
        elif num_streams < 1 or num_streams % world_size:
            problems.append(
                f"data.num_streams ({num_streams}) must be a positive multiple of the number of "
                f"processes ({world_size})"
            )
        elif not 0 <= num_workers <= num_streams // world_size:
            problems.append(
                f"data.num_workers ({num_workers}) must be between 0 and data.num_streams / processes "
                f"({num_streams // world_size}); each worker owns whole streams"
            )
        if world_size >= 1 and (rows_per_step < 1 or rows_per_step % world_size):
            problems.append(
                f"rows per step ({rows_per_step}) must be a positive multiple of world_size ({world_size})"
            )
        if seq_len < 1:
            problems.append(f"data.seq_len must be >= 1, got {seq_len}")
        if shuffle_window < 1:
            problems.append(f"data.shuffle_window must be >= 1, got {shuffle_window}")
        if problems:
            raise DataError("invalid data settings:\n  - " + "\n  - ".join(problems))

        self.specs, self.sources, self.encoder = _open_all(sources, tokenizer)
        self.tokenizer = tokenizer
        self.seq_len, self.num_streams, self.rows_per_step = seq_len, num_streams, rows_per_step
        self.rank, self.world_size, self.num_workers, self.seed = rank, world_size, num_workers, seed
        self.shuffle, self.shuffle_window = shuffle, shuffle_window
        self.owned = [s for s in range(num_streams) if s % world_size == rank]
        self.counts = rows_per_stream(rows_per_step, num_streams)
        for src in self.sources:
            _, keep_every, _ = shard_plan(src.n_shards, num_streams, 0)
            if keep_every > 1:
                logger.warning(
                    "source %s has %d shards for %d streams: streams share shards and keep every %d-th "
                    "document, so each reads ~%dx the data it uses; give it >= %d shards to avoid this",
                    src.label,
                    src.n_shards,
                    num_streams,
                    keep_every,
                    keep_every,
                    num_streams,
                )
        initial = StreamReader.initial_state(len(self.sources))
        self._states: dict[int, dict] = {s: copy.deepcopy(initial) for s in self.owned}
        self._loader_iter = None
        self._dataset: _StreamsDataset | None = None

    def __iter__(self) -> Iterator[StepRows]:
        """Start (or restart) from the current state: the last consumed step, or what `load_state_dict` set."""
        self.close()
        self._dataset = _StreamsDataset(
            self.sources,
            self.encoder,
            self.owned,
            copy.deepcopy(self._states),
            self.counts,
            seq_len=self.seq_len,
            num_streams=self.num_streams,
            seed=self.seed,
            shuffle=self.shuffle,
            window=self.shuffle_window,
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
                generator=torch.Generator().manual_seed(self.seed),
            )
            items = self._loader_iter = iter(loader)
        return self._steps(items)

    def _steps(self, items) -> Iterator[StepRows]:
        # DataLoader takes items round-robin from workers, and each worker yields one item per step.
        per_step = max(1, self.num_workers)
        while True:
            chunks, states = {}, {}
            for _ in range(per_step):
                c, s = next(items)
                chunks.update(c)
                states.update(s)
            rows = torch.cat([chunks[s] for s in self.owned]).long()
            self._states.update(states)  # only now is this step consumed
            yield StepRows(
                rows,
                epoch=min(st["sources"][0][0] for st in self._states.values()),
                skipped_docs=sum(p[3] for st in self._states.values() for p in st["sources"]),
            )

    def state_dict(self) -> dict:
        """Position of what was consumed: {"version", "num_streams", "streams": {stream id: plain dict}}."""
        return {
            "version": STATE_VERSION,
            "num_streams": self.num_streams,
            "streams": copy.deepcopy(self._states),
        }

    def load_state_dict(self, state: dict) -> None:
        """Take this rank's streams from a state holding (at least) them, e.g. all ranks' merged states."""
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
                "states of all ranks (merge_stream_states)"
            )
        self.close()
        self._states = {s: copy.deepcopy(streams[s]) for s in self.owned}

    def fingerprint(self) -> dict:
        """What the stream depends on. world_size and num_workers are informational: resuming across them is exact."""
        from lmpretrain.tokenizer import tokenizer_hash

        return {
            "sources": [asdict(s) for s in self.specs],
            "tokenizer": tokenizer_hash(self.tokenizer),
            "seq_len": self.seq_len,
            "num_streams": self.num_streams,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_window": self.shuffle_window,
            "world_size": self.world_size,
            "num_workers": self.num_workers,
        }

    def records_read(self) -> int:
        """Records this rank's in-process readers pulled from the sources (num_workers=0 only; for tests)."""
        if self.num_workers:
            raise RuntimeError("records_read is only tracked with num_workers=0")
        return sum(r.records_read for r in self._dataset.readers.values()) if self._dataset else 0

    def close(self) -> None:
        """Stop the dataloader workers, if any, and close in-process shard readers."""
        it, self._loader_iter = self._loader_iter, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        if self._dataset is not None:
            for reader in self._dataset.readers.values():
                reader.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def merge_stream_states(per_rank_states: list[dict]) -> dict:
    """Merge the `state_dict()`s of all ranks into one that any world size can `load_state_dict` from."""
    if not per_rank_states:
        raise DataError("no data states to merge")
    num_streams = {s["num_streams"] for s in per_rank_states}
    if len(num_streams) != 1:
        raise DataError(f"data states disagree on num_streams: {sorted(num_streams)}")
    merged: dict[int, dict] = {}
    for state in per_rank_states:
        for k, v in state["streams"].items():
            k = int(k)
            if k in merged and merged[k] != v:
                raise DataError(f"two ranks saved different states for stream {k}")
            merged[k] = copy.deepcopy(v)
    return {
        "version": STATE_VERSION,
        "num_streams": num_streams.pop(),
        "streams": dict(sorted(merged.items())),
    }


def heldout_blocks(sources: list[SourceSpec], tokenizer, *, seq_len: int, num_blocks: int) -> torch.Tensor:
    """The first `num_blocks` packed blocks of the held-out sources, read in order without shuffling."""
    _, opened, encoder = _open_all(sources, tokenizer)
    need = num_blocks * seq_len
    pieces, have, texts = [], 0, []

    def flush():
        nonlocal have
        for ids in encoder(texts):
            pieces.append(np.asarray(ids + [encoder.eos_id], dtype=np.int64))
            have += len(ids) + 1
        texts.clear()

    for src in opened:
        for shard in range(src.n_shards):
            for value in src.iter_shard(shard):
                if src.tokens:
                    if value is not None and len(value):
                        pieces.append(np.append(np.asarray(value, dtype=np.int64), encoder.eos_id))
                        have += len(value) + 1
                elif isinstance(value, str) and value:
                    texts.append(value)
                    if len(texts) >= 64:
                        flush()
                if have >= need:
                    break
            flush()
            if have >= need:
                break
        if have >= need:
            break
    if have < need:
        raise DataError(
            f"the held-out sources ({', '.join(s.label for s in opened)}) hold {have} tokens, fewer than "
            f"{num_blocks} blocks x {seq_len}; lower eval.batches or add held-out data"
        )
    return torch.from_numpy(np.concatenate(pieces)[:need].reshape(num_blocks, seq_len))
