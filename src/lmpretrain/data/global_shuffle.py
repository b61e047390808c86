"""`data.shuffle: global`: training blocks drawn from token files by a seeded permutation of every block
position in the corpus, a new permutation each epoch.

A token source is one logical stream of T tokens: its shards back to back (data/token_files.py). Its n =
T // seq_len blocks of epoch e start at o_e + i * seq_len (i = 0..n-1, modulo T: the last one may run on
from the stream's end to its start), so a block may span shards and an epoch draws every token but the
T % seq_len < seq_len before o_e; o_e in [0, seq_len) is a seeded offset per (seed, source id, epoch)
(`data.epoch_offset`; 0 when off), so epochs see new block boundaries. Epoch e reads block P_{seed,
source id, e}(i) for i = 0..n-1; P is a keyed bijection of [0, n) (a Feistel network cycle-walked into the
range), so it takes no memory and any index is computed directly. Draw t of the run comes from source k
with probability weight_k (a hash of (seed, t)); the global step's blocks are the next `blocks_per_step`
draws, and global block j of a step belongs to stream j % num_streams, as in the window path
(train_stream.py): world size and workers change who reads a block, not which. The position is, per
source, (epoch, index) plus the draw counter (the epoch's offset follows from it): a restore computes the
next blocks from it and reads nothing else. Sources are known by id (data/mixture.py), so a source keeps
its permutations and position when others are added, removed or reweighted at resume.
"""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from lmpretrain.config import SHUFFLES
from lmpretrain.data.block_stream import uniform
from lmpretrain.data.sources import Source
from lmpretrain.errors import DataError, UserError

TAG_PERMUTATION, TAG_GLOBAL_MIX, TAG_EPOCH_OFFSET = 11, 12, 13
GRID = "stream"  # in the state: blocks cut from each source's one stream (older states cut them per shard)
_ROUNDS = 6
CHUNK = 1 << 16  # permutation values computed (and kept) at a time per source: vectorised, constant memory
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def resolve_shuffle(value, sources: list[Source]) -> str:
    """data.shuffle as one of SHUFFLES: null means global when every train source is token files, else
    windows; the former booleans mean windows (true) and none (false)."""
    tokens = all(src.token_files is not None for src in sources)
    if value is None:
        return "global" if tokens else "windows"
    value = {True: "windows", False: "none", "true": "windows", "false": "none"}.get(value, value)
    if value not in SHUFFLES:
        raise DataError(f"data.shuffle must be one of {SHUFFLES} (or null for the default), got {value!r}")
    if value == "global" and not tokens:
        text = [src.label for src in sources if src.token_files is None]
        raise DataError(
            f"data.shuffle=global draws blocks from token files, but {text} are not token files; prepare them "
            "with scripts/prepare_data.py (then `format: tokens`), or set data.shuffle=windows"
        )
    return value


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def permute(index: np.ndarray, n: int, *key: int) -> np.ndarray:
    """P(index) for the keyed bijection P of [0, n): a balanced Feistel network on the smallest even
    number of bits covering n, applied again to values that land outside [0, n) (cycle walking)."""
    half = max(1, (max(1, int(n - 1).bit_length()) + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8 * _ROUNDS).digest()
    keys = np.frombuffer(digest, dtype="<u8")

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << np.uint64(half)) | right

    with np.errstate(over="ignore"):
        out = feistel(np.asarray(index, dtype=np.uint64))
        outside = out >= n
        while outside.any():
            out[outside] = feistel(out[outside])
            outside = out >= n
    return out.astype(np.int64)


def _keyed(*key: int) -> int:
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


class GlobalOrder:
    """The run's block order over token sources (see the module docstring); the state is plain data."""

    def __init__(
        self, sources: list[Source], seq_len: int, seed: int, add_bos: bool, epoch_offset: bool = True
    ):
        for src in sources:
            if src.token_files.add_bos != add_bos:
                raise DataError(
                    f"source {src.label}: token files were prepared with add_bos={src.token_files.add_bos}, "
                    f"the run has data.add_bos={add_bos}; set data.add_bos={str(src.token_files.add_bos).lower()}"
                    " or prepare them again (the global shuffle reads documents as framed on disk)"
                )
            if src.token_files.tokens < seq_len:
                raise DataError(f"source {src.label} holds no block of {seq_len} tokens; lower data.seq_len")
        self.files = [src.token_files for src in sources]
        self.blocks = [f.tokens // seq_len for f in self.files]
        weights = np.array([src.spec.weight for src in sources], dtype=np.float64)
        self.cum_weights = np.cumsum(weights / weights.sum())
        self.seq_len, self.seed, self.epoch_offset = seq_len, seed, epoch_offset
        self.source_ids = list(range(len(sources)))  # keys of each source's permutations and offsets
        self._chunks: dict[int, tuple[tuple[int, int], np.ndarray]] = {}  # source -> ((epoch, chunk), values)

    def set_source_ids(self, ids: list[int]) -> None:
        """The sources' ids in the run (data/mixture.py: kept across mixture changes)."""
        self.source_ids = list(ids)
        self._chunks.clear()

    def offset(self, k: int, epoch: int) -> int:
        """Where epoch `epoch`'s block grid starts in source k's stream."""
        if not self.epoch_offset:
            return 0
        return _keyed(self.seed, TAG_EPOCH_OFFSET, self.source_ids[k], epoch) % self.seq_len

    def _permuted(self, k: int, epoch: int, start: int, count: int) -> np.ndarray:
        """P_{seed, id_k, epoch}(start ... start + count - 1), within one epoch, through the chunk cache."""
        out, n, sid = [], self.blocks[k], self.source_ids[k]
        while count:
            chunk = start // CHUNK
            key, cached = self._chunks.get(k, (None, None))
            if key != (epoch, chunk):
                lo = chunk * CHUNK
                cached = permute(np.arange(lo, min(n, lo + CHUNK)), n, self.seed, TAG_PERMUTATION, sid, epoch)
                self._chunks[k] = ((epoch, chunk), cached)
            take = min(count, (chunk + 1) * CHUNK - start)
            out.append(cached[start - chunk * CHUNK : start - chunk * CHUNK + take])
            start, count = start + take, count - take
        return np.concatenate(out) if len(out) != 1 else out[0]

    def initial_state(self) -> dict:
        return {"grid": GRID, "draws": 0, "sources": [[0, 0] for _ in self.files]}

    def check_state(self, state: dict) -> None:
        if "draws" not in state or len(state.get("sources", [])) != len(self.files):
            raise DataError(
                "the data state was not saved by the global shuffle over these sources (data.shuffle or "
                "data.train changed); resume with the same data settings"
            )
        if state.get("grid") != GRID:
            raise DataError(
                "the data state was saved by an older lmpretrain whose global shuffle cut blocks shard by "
                "shard; this one reads each source as one stream, so the position does not carry over: start "
                "the run fresh (--run.resume=never) in another output_dir"
            )

    def next_draws(self, state: dict, count: int) -> tuple[list[tuple[int, int]], dict]:
        """The next `count` draws as (source, first token in its stream) and the state after them."""
        tokens = list(state.get("tokens") or [0] * len(self.files))  # per source, drawn so far (all streams)
        state = {
            "grid": state.get("grid"),
            "draws": state["draws"],
            "sources": [list(p) for p in state["sources"]],
        }
        t = state["draws"]
        if len(self.files) == 1:
            chosen = None
        else:
            u = np.array([uniform(self.seed, TAG_GLOBAL_MIX, t + j) for j in range(count)])
            chosen = np.minimum(np.searchsorted(self.cum_weights, u, side="right"), len(self.files) - 1)
        draws: list[tuple[int, int]] = [(0, 0)] * count
        for k in [0] if chosen is None else np.unique(chosen).tolist():
            where = np.arange(count) if chosen is None else np.flatnonzero(chosen == k)
            epoch, index = state["sources"][k]
            n, got = self.blocks[k], 0
            while got < len(where):  # one permutation (and grid offset) per epoch the draws reach
                take = min(len(where) - got, n - index)
                starts = self.offset(k, epoch) + self._permuted(k, epoch, index, take) * self.seq_len
                for j, b in zip(where[got : got + take].tolist(), starts.tolist(), strict=True):
                    draws[j] = (k, b)
                got, index = got + take, index + take
                if index == n:
                    epoch, index = epoch + 1, 0
            state["sources"][k] = [epoch, index]
            tokens[k] += len(where) * self.seq_len
        state["draws"] = t + count
        state["tokens"] = tokens
        return draws, state

    def read(self, draws: list[tuple[int, int]]) -> np.ndarray:
        if len(self.files) == 1:
            return self.files[0].read_blocks(np.array([b for _, b in draws]), self.seq_len)
        out = np.empty((len(draws), self.seq_len), dtype=np.int32)
        for k, files in enumerate(self.files):
            rows = [j for j, (src, _) in enumerate(draws) if src == k]
            if rows:
                out[rows] = files.read_blocks(np.array([draws[j][1] for j in rows]), self.seq_len)
        return out


class GlobalBlocksDataset(IterableDataset):
    """Yields, per step, the items `TrainStream` reads from its workers (as `_StreamsDataset` does): every
    process computes the step's draws and reads the blocks of the streams it owns."""

    def __init__(self, order: GlobalOrder, streams: list[int], state: dict, sizes):
        """`sizes`: train_stream.StepSizes, the blocks each stream gives to each step."""
        super().__init__()
        self.order, self.streams, self.state, self.sizes = order, streams, state, sizes
        self.block_streams: dict = {}  # TrainStream.close() walks the window path's streams

    def __iter__(self):
        info = get_worker_info()
        mine = self.streams if info is None else self.streams[info.id :: info.num_workers]
        num_streams, state = self.sizes.num_streams, self.state
        try:
            self.order.check_state(state)
            for step in itertools.count(self.sizes.first):
                counts = self.sizes.counts(step)
                per_step = sum(counts)
                needed = [j for s in mine for j in range(s, per_step, num_streams)]  # stream by stream
                bounds = np.cumsum([0] + [counts[s] for s in mine]).tolist()
                draws, state = self.order.next_draws(state, per_step)
                read = torch.from_numpy(self.order.read([draws[j] for j in needed]))
                blocks = {s: read[bounds[i] : bounds[i + 1]] for i, s in enumerate(mine)}
                epoch, none = state["sources"][0][0], [0] * len(state["tokens"])
                # Every stream holds the same (global) counts; stream 0 reports them, so the ranks' sum is right.
                progress = {s: (epoch, 0, state["tokens"] if s == 0 else none) for s in mine}
                yield blocks, {s: state for s in mine}, progress, []
        except UserError as err:
            if info is None:
                raise
            yield err
