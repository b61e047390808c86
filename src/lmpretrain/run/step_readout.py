"""The optimizer step's one device->host read, combined over the ranks.

A step's numbers live on the device until its end: each objective term's (sum, count) per micro-batch,
the global target count and the clipped gradient norm, plus a few host numbers per rank (a stop flag,
the data's counters). Reading each one separately would synchronise the device once per number; gathering
them as one tensor synchronises once, and every rank then combines the same gathered rows the same way.
The host numbers go to the device from pinned memory without waiting (a copy from pageable memory would
block: a second synchronisation). Everything travels as float64; an integer (a token counter past 2^53,
where float64 rounds, or past 2^24 where float32 did) as two exact float64 halves, so it comes back exact.
"""

from __future__ import annotations

import math
import numbers

import torch

from lmpretrain.errors import DataError

_HALF = 2**32


def _host_row(host: dict, device: torch.device) -> torch.Tensor:
    """This rank's host numbers as float64 on `device`: a float as one value, an integer as (v // 2^32,
    v % 2^32), both exact in float64; copied from pinned memory, so the copy does not make the host wait."""
    values = []
    for value, _ in host.values():
        values += divmod(int(value), _HALF) if isinstance(value, numbers.Integral) else [float(value)]
    row = torch.tensor(values, dtype=torch.float64)  # on the host
    if device.type == "cuda":
        row = row.pin_memory()
    return row.to(device, non_blocking=True)


def read_step(accelerator, sums: dict[str, torch.Tensor], host: dict, n_targets, grad_norm):
    """Returns (term means over the global batch, the gradient norm, the host numbers combined).

    `sums`: name -> a device tensor [sum, count] over this rank's micro-batches; `host`: name ->
    (value, "sum" | "min" | "max" | "each"), how the ranks' values combine ("each": the list of every
    rank's value, in rank order; integers stay exact Python ints); `n_targets`: the global target count.
    """
    if hasattr(grad_norm, "full_tensor"):  # FSDP2 returns the norm as a replicated DTensor
        grad_norm = grad_norm.full_tensor()
    device = n_targets.device
    mine = torch.cat([torch.stack(list(sums.values())).flatten().double(), _host_row(host, device)])
    extra = [n_targets.double().reshape(1)]
    if isinstance(grad_norm, torch.Tensor):
        extra.append(grad_norm.to(device).double().reshape(1))
    else:  # DeepSpeed's engine hands over a number it has read already (or None)
        grad_norm = math.nan if grad_norm is None else float(grad_norm)
    # The step's one blocking read: every rank's row, the target count and the norm.
    values = torch.cat([accelerator.gather(mine[None]).flatten(), *extra]).tolist()
    ranks, n = values[: -len(extra)], values[-len(extra)]
    if len(extra) == 2:
        grad_norm = values[-1]
    return _combine(ranks, n, grad_norm, sums, host, accelerator.num_processes, len(mine))


def _combine(ranks: list[float], n: float, grad_norm, sums: dict, host: dict, world: int, width: int):
    per_rank = [ranks[r * width : (r + 1) * width] for r in range(world)]
    if n == 0:
        raise DataError(
            "every target of the global batch is ignored (-100), so there is no loss to train on; every "
            "token starts a document, too short for train.mask_cross_doc_targets=true"
        )
    total = [sum(column) for column in zip(*per_rank, strict=True)]
    means = {name: total[2 * i] / max(total[2 * i + 1], 1) for i, name in enumerate(sums)}
    combine = {"sum": sum, "min": min, "max": max, "each": list}
    shared, at = {}, 2 * len(sums)
    for name, (value, op) in host.items():
        if isinstance(value, numbers.Integral):
            got = [int(row[at]) * _HALF + int(row[at + 1]) for row in per_rank]
            at += 2
        else:
            got = [row[at] for row in per_rank]
            at += 1
        shared[name] = combine[op](got)
    return means, grad_norm, shared
