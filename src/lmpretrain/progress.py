"""Progress for the long steps outside the training loop (corpus build, tokenizer training, pre-tokenizing,
the held-out read): one `[lmpretrain]` line before any wait, and a tqdm bar, on the main process only.

The main process is the one whose `RANK` (set by `accelerate launch` / torchrun) is 0, or a plain process.
Bars are off under `CI=true`: redrawn bars fill CI logs; the announcing lines stay.
"""

from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm


def is_main_process() -> bool:
    """True outside distributed launches and on global rank 0."""
    return os.environ.get("RANK", "0") == "0"


def bars_enabled() -> bool:
    """Progress bars only where someone watches: the main process, not under CI."""
    return is_main_process() and os.environ.get("CI", "").lower() != "true"


def announce(message: str) -> None:
    """Say what is about to happen (main process only), before a wait a user would otherwise sit through blind."""
    if is_main_process():
        print(f"[lmpretrain] {message}", file=sys.stderr, flush=True)


def bar(*, desc: str, unit: str, total: int | None = None, enabled: bool = True, scale: bool = True) -> tqdm:
    """A tqdm bar that draws only when `enabled` and `bars_enabled()`; always safe to update and close.
    `scale`: counts in k/M (tokens, files), not for a few dozen shards."""
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=scale,
        dynamic_ncols=True,
        mininterval=0.5,
        disable=not (enabled and bars_enabled()),
    )


def step_bar(*, total: int, initial: int, enabled: bool) -> tqdm:
    """The training loop's bar (optimizer steps), on the main process; shown under CI too: it is the
    loop's heartbeat."""
    return tqdm(
        total=total,
        initial=initial,
        disable=not enabled,
        desc="pretrain",
        unit="step",
        dynamic_ncols=True,
        mininterval=1.0,
    )
