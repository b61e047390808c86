"""Streamed, tokenized, packed training data with an exact resumable position per virtual stream.

sources.py (what a source is, its pieces) -> readers.py (one piece from a position) -> cursor.py (a stream's
position in a source) -> block_stream.py (one stream: document windows, packing, block windows) ->
train_stream.py (a rank's blocks per step, workers, state); mixture.py (mixtures that change at resume);
heldout.py (the eval set); encoder.py (text -> ids with the BOS/EOS contract); prepare.py (the datatrove
pipeline that writes token files); token_layouts.py (the token layouts read: ours, datatrove's, Megatron's)
-> token_files.py (token files: one stream of token ids per source, read by offset) -> global_shuffle.py
(`data.shuffle: global`, a seeded permutation of every block per epoch, a seeded grid offset); tokenizer.py
and corpus.py (the default tokenizer and its corpus, built locally).
"""

from lmpretrain.data.batch_ramp import BatchRamp
from lmpretrain.data.heldout import heldout_blocks
from lmpretrain.data.mixture import mixture_change
from lmpretrain.data.sources import Source, SourceSpec, expand_files, open_source
from lmpretrain.data.tokenizer import load_tokenizer
from lmpretrain.data.train_stream import (
    StepBlocks,
    TrainStream,
    blocks_per_stream,
    merge_data_states,
    step_counters,
)

__all__ = [
    "BatchRamp",
    "Source",
    "SourceSpec",
    "StepBlocks",
    "TrainStream",
    "blocks_per_stream",
    "expand_files",
    "heldout_blocks",
    "load_tokenizer",
    "merge_data_states",
    "mixture_change",
    "open_source",
    "step_counters",
]
