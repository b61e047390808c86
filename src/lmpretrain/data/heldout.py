"""The held-out set: the first blocks of the eval sources, read in order (no shuffle), framed like training
documents ([BOS] ids EOS), so eval loss is measured on the same kind of token stream."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from lmpretrain.data.block_stream import frame_units
from lmpretrain.data.cursor import SourceCursor
from lmpretrain.data.encoder import Encoder
from lmpretrain.data.sources import open_sources
from lmpretrain.errors import DataError
from lmpretrain.observe.progress import bar

if TYPE_CHECKING:
    from lmpretrain.config import DataConfig

logger = logging.getLogger(__name__)

_BATCH_UNITS, _BATCH_CHARS = 64, 1 << 16  # units tokenized per batch
# No document fills more than this share of the set: read in order, a held-out set of 16k tokens can be
# mostly one long file (the stdlib's codec tables are), and then it measures that file, not the corpus.
MIN_DOCUMENTS = 16


def heldout_blocks(data: DataConfig, tokenizer, *, num_blocks: int, progress: bool = False) -> torch.Tensor:
    """The first `num_blocks` packed `data.seq_len` blocks of `data.eval`, each source read once in order,
    each document cut to its first 1/MIN_DOCUMENTS of the set (at least one block).
    `progress`: draw a bar (pass True on the main process only)."""
    encoder = Encoder(tokenizer, data.add_bos)
    sources = open_sources(data.eval, tokenizer)
    need = num_blocks * data.seq_len
    cap = max(data.seq_len, need // MIN_DOCUMENTS)
    pieces: list[np.ndarray] = []
    have = 0
    with bar(desc="held-out set", unit="block", total=num_blocks, enabled=progress) as shown:
        for src in sources:
            cursor = SourceCursor(src, 0, 0, 1, seed=0, shuffle=False)
            done = False
            while have < need and not done:
                batch, chars = [], 0
                while len(batch) < _BATCH_UNITS and chars < _BATCH_CHARS:
                    unit = cursor.next_unit()
                    if cursor.epoch > 0:  # one pass only
                        done = True
                        break
                    batch.append((src, unit))
                    chars += len(unit.value)
                for array in frame_units(encoder, batch):
                    array = array[:cap]
                    pieces.append(array)
                    have += len(array)
                shown.update(min(have, need) // data.seq_len - shown.n)
            cursor.close()
            for _, report in cursor.notes:  # bad records of held-out sources are skipped and said too
                logger.warning(report)
            if have >= need:
                break
    if have < need:
        raise DataError(
            f"the held-out sources ({', '.join(s.label for s in sources)}) hold {have} tokens, fewer than "
            f"{num_blocks} blocks x {data.seq_len}; lower eval.batches or add held-out data"
        )
    return torch.from_numpy(np.concatenate(pieces)[:need].astype(np.int64).reshape(num_blocks, data.seq_len))
