"""Saving and resuming: atomic checkpoints (full, sharded, async), their formats, the final export."""

from lmpretrain.checkpoint.checkpointer import Checkpointer, PerRank, check_output_dir_writable
from lmpretrain.checkpoint.export import auxiliary, export_pretrained

__all__ = [
    "Checkpointer",
    "PerRank",
    "check_output_dir_writable",
    "export_pretrained",
    "auxiliary",
]
