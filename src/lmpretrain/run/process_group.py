"""How the ranks join one process group: a fresh store namespace for each torch elastic restart, and a
timeout on every collective.

Verified with torch 2.13 and `accelerate launch --max_restarts=2` (its default `rdzv_backend: static`):
after a rank is killed, torch elastic restarts the group, but the restarted ranks fail in gloo's
connectFullMesh ("Connection refused") because they read the *killed* ranks' addresses. The static
rendezvous keeps one TCPStore, in the launcher, for every attempt (`StaticTCPRendezvous.next_rendezvous`
reuses ``self._store`` under the same prefix), and `env://` hands the ranks that store unprefixed (torch's
comment there assumes "a new TCPStore for every retry"); so attempt 1 finds attempt 0's keys, and a rank
connects to the old address before the new one is written. The `lmpretrain://` rendezvous below is
`env://` with the store scoped to the attempt (``TORCHELASTIC_RESTART_COUNT``), whatever rendezvous
backend the launcher uses; accelerate still chooses the backend and initialises the group.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist
from accelerate.utils import InitProcessGroupKwargs
from torch.distributed.rendezvous import register_rendezvous_handler, rendezvous

SCHEME = "lmpretrain"


def restart_count() -> int:
    """How many times torch elastic has restarted this group (0: the first attempt, or no launcher)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _attempt_rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs):
    query = url.partition("?")[2]
    store, rank, world_size = next(rendezvous(f"env://?{query}" if query else "env://", timeout=timeout))
    yield dist.PrefixStore(f"lmpretrain/attempt_{restart_count()}", store), rank, world_size
    raise RuntimeError("lmpretrain:// rendezvous cannot re-rendezvous: torch elastic restarts the processes")


register_rendezvous_handler(SCHEME, _attempt_rendezvous)


def process_group_kwargs(timeout_s: float, backend: str | None = None) -> InitProcessGroupKwargs:
    """accelerate's init_process_group arguments: the attempt-scoped rendezvous, and ``timeout_s`` as the
    process group's timeout, after which a collective that some rank never joins raises on the others
    (gloo and NCCL both take it from init_process_group)."""
    kwargs = {"backend": backend} if backend else {}
    return InitProcessGroupKwargs(init_method=f"{SCHEME}://", timeout=timedelta(seconds=timeout_s), **kwargs)
