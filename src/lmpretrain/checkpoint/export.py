"""The run's product, ``<output_dir>/final/``: a plain ``save_pretrained`` model + tokenizer, written
atomically (a temporary directory renamed into place), so an interrupted export never leaves a model
that half loads."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lmpretrain.checkpoint.checkpointer import fsync_path, fsync_tree
from lmpretrain.model import mup
from lmpretrain.run.distributed import broadcast_int

AUXILIARY = "lmpretrain_auxiliary"


def auxiliary(module):
    """Mark `module`, a fork's addition to the model (a multi-token-prediction head, a probe), as trained
    and checkpointed but left out of the export, so final/ loads as the plain model class. Returns it."""
    setattr(module, AUXILIARY, True)
    return module


def auxiliary_prefixes(model) -> tuple[str, ...]:
    """The parameter-name prefixes of the modules marked `auxiliary` in `model`."""
    return tuple(f"{name}." for name, module in model.named_modules() if getattr(module, AUXILIARY, False))


def _tied_aliases(model) -> set[str]:
    """Names of parameters that are another parameter (tied embeddings): gathered shards arrive as
    separate copies, and save_pretrained would keep whichever name it meets; keep the first name."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {alias for group in names.values() for alias in group[1:]}


def export_pretrained(model, tokenizer, path, accelerator) -> Path:
    """Write ``model`` and ``tokenizer`` to ``path`` for ``from_pretrained``; every rank must call it
    (sharded weights are gathered to the main process, which writes)."""
    path = Path(path)
    inner = accelerator.unwrap_model(model)
    left_out = auxiliary_prefixes(inner)
    folded = mup.of(inner)  # μP's logit, attention and residual-branch multipliers, folded into plain weights
    if type(model).__name__ == "DeepSpeedEngine":
        # ZeRO-1/2 ranks hold whole weights; the module saves its own (keeping tied embeddings tied).
        weights = None
        if left_out or folded:
            weights = {k: v for k, v in inner.state_dict().items() if not k.startswith(left_out)}
    else:
        weights = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        aliases = _tied_aliases(inner)
        weights = {k: v for k, v in weights.items() if k not in aliases and not k.startswith(left_out)}
    if folded and weights is not None:
        weights = folded.fold_for_export(weights)
    nonce = broadcast_int(int.from_bytes(os.urandom(6), "little"), accelerator)
    if accelerator.is_main_process:
        for leftover in path.parent.glob(f".tmp-{path.name}-*"):  # from an export that was killed
            shutil.rmtree(leftover, ignore_errors=True)
        tmp = path.with_name(f".tmp-{path.name}-{nonce:012x}")
        accelerator.unwrap_model(model, keep_torch_compile=False).save_pretrained(
            tmp, state_dict=weights, safe_serialization=True
        )
        tokenizer.save_pretrained(tmp)
        fsync_tree(tmp)
        trash = path.with_name(f".trash-{path.name}-{nonce:012x}")
        if path.exists():  # a rerun that trained further: swap the old export out
            os.rename(path, trash)
        os.rename(tmp, path)
        fsync_path(path.parent)
        shutil.rmtree(trash, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path
