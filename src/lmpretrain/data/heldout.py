"""The held-out set: blocks of the eval sources, read once in order (no shuffle), framed like training
documents ([BOS] ids EOS), so eval loss is measured on the same kind of token stream.

No document fills more than 1/MIN_DOCUMENTS of the set while the sources hold enough documents: read in
order, a held-out set of 16k tokens could otherwise be mostly one long file (the stdlib's codec tables
are), and then it measures that file, not the corpus; each document then gives its first tokens. Sources
with fewer documents (one `val.txt`) are shared out evenly instead: every document gives an equal share,
and one longer than its share gives `seq_len`-token windows spread evenly from its start to its end.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from lmpretrain.data.block_stream import frame_units
from lmpretrain.data.cursor import SourceCursor
from lmpretrain.data.encoder import Encoder
from lmpretrain.data.sources import open_sources
from lmpretrain.data.transforms import load_transforms
from lmpretrain.errors import DataError
from lmpretrain.progress import announce, bar

if TYPE_CHECKING:
    from lmpretrain.config import DataConfig

logger = logging.getLogger(__name__)

_BATCH_UNITS, _BATCH_CHARS = 64, 1 << 16  # units tokenized per batch
MIN_DOCUMENTS = 16  # a document gives at most 1/MIN_DOCUMENTS of the set when there are enough documents
# Tokens held at most: max(this, MIN_DOCUMENTS x the set). Bounds memory and start-up time when the sources
# are a few huge documents (spread over their first tokens up to this limit).
READ_LIMIT = 1 << 22


def heldout_blocks(
    data: DataConfig, tokenizer, num_blocks: int, add_bos: bool | None = None, progress: bool = False
) -> torch.Tensor:
    """`num_blocks` packed `data.seq_len` blocks of `data.eval` (see the module docstring for which tokens),
    framed as `add_bos` says (the training stream's: `TrainStream.encoder.add_bos`; default data.add_bos).
    `progress`: draw a bar (pass True on the main process only)."""
    encoder = Encoder(tokenizer, data.add_bos if add_bos is None else add_bos)
    transforms = load_transforms(data.transforms)
    sources = open_sources(data.eval, tokenizer, transforms, data.max_open_files, data.tokenizer)
    need = num_blocks * data.seq_len
    cap = max(data.seq_len, need // MIN_DOCUMENTS)
    with bar(desc="held-out set", unit="block", total=num_blocks, enabled=progress) as shown:
        docs = _read_documents(
            sources, encoder, need, cap, lambda have: shown.update(have // data.seq_len - shown.n), transforms
        )
        held = sum(len(d) for d in docs)
        shown.update(min(held, need) // data.seq_len - shown.n)
    if sum(min(len(d), cap) for d in docs) >= need:
        tokens = np.concatenate([d[:cap] for d in docs])  # enough documents: each gives its first tokens
    elif held >= need:
        share = _even_share([len(d) for d in docs], need)
        tokens = np.concatenate([_spread(d, share, data.seq_len) for d in docs])
        announce(
            f"held-out set: {len(docs)} document(s) of {held:,} tokens for {need:,}, so each gives up to {share:,} "
            f"tokens ({data.seq_len}-token windows spread through longer ones), not the first {cap:,}"
        )
    else:
        labels = ", ".join(s.label for s in sources)
        raise DataError(
            f"the held-out sources ({labels}) hold {held:,} tokens in {len(docs)} document(s), all of them "
            f"read whole (nothing capped), fewer than the {num_blocks} blocks x {data.seq_len} = {need:,} "
            "tokens the held-out set needs (eval.batches x eval.batch_size blocks of data.seq_len); lower "
            "eval.batches or eval.batch_size, or add held-out data"
        )
    return torch.from_numpy(tokens[:need].astype(np.int64).reshape(num_blocks, data.seq_len))


def _read_documents(sources, encoder: Encoder, need: int, cap: int, progress, transforms) -> list[np.ndarray]:
    """Framed token arrays of whole documents, each source read once in order (through `transforms`, a
    stateful one's state running on over the sources), until the capped documents fill the set or the read
    limit is held."""
    chain = transforms.chain() if transforms else None
    limit = max(READ_LIMIT, MIN_DOCUMENTS * need)
    docs: list[np.ndarray] = []
    current: list[np.ndarray] = []  # units of the document being read
    capped = held = 0

    def enough() -> bool:
        return capped >= need or held >= limit

    for src in sources:
        cursor = SourceCursor(src, 0, 0, 1, seed=0, shuffle=False, transform=chain)
        done = False
        while not enough() and not done:
            batch, chars = [], 0
            while len(batch) < _BATCH_UNITS and chars < _BATCH_CHARS:
                unit = cursor.next_unit()
                if cursor.epoch > 0:  # one pass only
                    done = True
                    break
                batch.append((src, unit))
                chars += len(unit.value)
            for (_, unit), array in zip(batch, frame_units(encoder, batch), strict=True):
                current.append(array)
                held += len(array)
                if unit.last:
                    docs.append(np.concatenate(current))
                    capped += min(len(docs[-1]), cap)
                    current = []
            progress(min(capped, need))
        cursor.close()
        for _, report in cursor.notes:  # bad records of held-out sources are skipped and said too
            logger.warning(report)
        if current:  # a document cut short by the read limit
            docs.append(np.concatenate(current))
            current = []
        if enough():
            break
    return docs


def _even_share(lengths: list[int], need: int) -> int:
    """The smallest per-document share s with sum(min(length, s)) >= need (lengths sum to >= need)."""
    lo, hi = math.ceil(need / len(lengths)), max(lengths)
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(min(n, mid) for n in lengths) >= need:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _spread(doc: np.ndarray, share: int, window: int) -> np.ndarray:
    """`share` tokens of `doc`: all of it if it is no longer, else windows of `window` tokens at evenly
    spaced starts from its first token to its last (so they include its BOS and its EOS)."""
    if len(doc) <= share:
        return doc
    k = math.ceil(share / window)
    if len(doc) < k * window:  # barely longer than its share: windows would overlap
        return doc[:share]
    starts = np.linspace(0, len(doc) - window, k).round().astype(np.int64).tolist()
    last = share - window * (k - 1)  # the last window is shorter and ends with the document
    return np.concatenate([doc[s : s + window] for s in starts[:-1]] + [doc[len(doc) - last :]])
