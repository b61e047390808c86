"""What a run fetches at start-up is fetched once per machine, not once per process.

At 64-1,024 processes, every rank asking the Hub for the same tokenizer, task data and held-out rows is
rate limits and cache-lock contention. ``local_main_first(fn, state)`` runs ``fn`` on each machine's main
process first (it downloads into the machine's Hugging Face cache, huggingface_hub's and datasets' own),
then on the machine's other processes with the Hub offline (``hub_cache_only``: the same
``HF_HUB_OFFLINE`` switch the libraries read, so they read that cache and send no request).
``on_rank_zero(fn)`` is for what is not cached at all (a Hub dataset's listing, the held-out set's rows):
rank 0 computes it and broadcasts the result. In both, an error of the process that went first is raised
on every process with its message, so no process waits for a result that never comes.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch.distributed as dist

from lmpretrain import errors
from lmpretrain.errors import UserError
from lmpretrain.run.distributed import first_problem


def _distributed(state) -> bool:
    return (
        state is not None
        and getattr(state, "num_processes", 1) > 1
        and dist.is_available()
        and dist.is_initialized()
    )


@contextmanager
def hub_cache_only():
    """huggingface_hub (and so transformers) and datasets in offline mode for the block: files come from
    the cache, and a file that is not there fails as it would with HF_HUB_OFFLINE=1."""
    from huggingface_hub import constants

    datasets_config = sys.modules.get("datasets.config")  # imported only where datasets is used
    saved = constants.HF_HUB_OFFLINE, getattr(datasets_config, "HF_HUB_OFFLINE", None)
    constants.HF_HUB_OFFLINE = True
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = saved[0]
        if datasets_config is not None:
            datasets_config.HF_HUB_OFFLINE = saved[1]


def local_main_first(fn, state):
    """fn() on each machine's main process, then on its other processes from the cache it filled (every
    process gets its own result: a tokenizer, loaded tasks). Every process must call it."""
    if not _distributed(state):
        return fn()
    first = state.local_process_index == 0
    result, error = None, None
    if first:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - re-raised below, after every process knows
            error = err
    problem = first_problem(None if error is None else _message(error), state)
    if error is not None:
        raise error
    if problem is not None:
        raise UserError(problem)
    if first:
        return result
    with hub_cache_only():
        return fn()


_alone = False  # rank 0 is inside on_rank_zero's fn


def on_rank_zero(fn):
    """fn() run by rank 0 alone and its result (or its error) given to every rank of the job, so a listing
    or a read costs O(files) requests, not O(ranks x files). Outside a distributed job, just fn()."""
    if _alone or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn()  # (within another on_rank_zero: rank 0 alone runs it, the others wait for the outer one)
    box: list = [None]
    error = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", _by_rank_zero_alone(fn))
        except Exception as err:  # noqa: BLE001 - the other ranks must not wait for a result that never comes
            error, box[0] = err, ("error", (type(err).__name__, _message(err)))
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    kind, value = box[0]
    if kind == "error":
        raise _same_kind(*value)
    return value


def _by_rank_zero_alone(fn):
    global _alone
    _alone = True
    try:
        return fn()
    finally:
        _alone = False


def _same_kind(name: str, message: str) -> UserError:
    """Rank 0's error as this rank's: the same lmpretrain error class where it takes one message."""
    cls = getattr(errors, name, None)
    one_message = isinstance(cls, type) and issubclass(cls, UserError) and cls is not errors.ConfigError
    return cls(message) if one_message else UserError(message)


def _message(err: Exception) -> str:
    return str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {err}"
