"""Streamed, tokenized, packed training data with an exact resumable position per virtual stream."""

from lmpretrain.data.loader import StepRows, TrainStream, heldout_blocks, merge_stream_states, rows_per_stream
from lmpretrain.data.sources import Source, SourceSpec, expand_files, open_source

__all__ = [
    "Source",
    "SourceSpec",
    "StepRows",
    "TrainStream",
    "expand_files",
    "heldout_blocks",
    "merge_stream_states",
    "open_source",
    "rows_per_stream",
]
