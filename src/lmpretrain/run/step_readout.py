"""The optimizer step's one device->host read, combined over the ranks.

A step's numbers live on the device until its end: each objective term's (sum, count) per micro-batch,
the global target count and the clipped gradient norm, plus a few host numbers per rank (a stop flag,
the data's counters). Reading each one separately would synchronise the device once per number; gathering
them as one tensor synchronises once, and every rank then combines the same gathered rows the same way.
"""

from __future__ import annotations

import torch

from lmpretrain.errors import DataError


def read_step(accelerator, sums: dict[str, torch.Tensor], host: dict, n_targets, grad_norm):
    """Returns (term means over the global batch, the gradient norm, the host numbers combined).

    `sums`: name -> a device tensor [sum, count] over this rank's micro-batches; `host`: name ->
    (value, "sum" | "min" | "max" | "each"), how the ranks' values combine ("each": the list of every
    rank's value, in rank order); `n_targets`: the global target count.
    """
    if hasattr(grad_norm, "full_tensor"):  # FSDP2 returns the norm as a replicated DTensor
        grad_norm = grad_norm.full_tensor()
    device = n_targets.device
    mine = torch.cat(
        [
            torch.stack(list(sums.values())).flatten(),
            torch.tensor([v for v, _ in host.values()], device=device),
        ]
    )
    extra = torch.stack([n_targets.double(), torch.as_tensor(grad_norm, device=device).double()])
    *ranks, n, grad_norm = torch.cat([accelerator.gather(mine.double()[None]).flatten(), extra]).tolist()
    per_rank = [ranks[r * len(mine) : (r + 1) * len(mine)] for r in range(accelerator.num_processes)]
    if n == 0:
        raise DataError(
            "every target of the global batch is ignored (-100), so there is no loss to train on; every "
            "token starts a document, too short for train.mask_cross_doc_targets=true"
        )
    total = [sum(column) for column in zip(*per_rank, strict=True)]
    means = {name: total[2 * i] / max(total[2 * i + 1], 1) for i, name in enumerate(sums)}
    combine = {"sum": sum, "min": min, "max": max, "each": list}
    shared = {
        name: combine[op](row[2 * len(sums) + i] for row in per_rank)
        for i, (name, (_, op)) in enumerate(host.items())
    }
    return means, grad_norm, shared
