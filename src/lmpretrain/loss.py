"""Causal LM loss as a token *sum*, so the recipe can divide by the global number of targets.

Averaging per-micro-batch means weights a micro-batch with few kept tokens as much as a full one;
summing here and normalising once by the count over all micro-batches and ranks makes gradient
accumulation and data parallelism equal one big batch.
"""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def make_labels(input_ids: torch.Tensor, ignore_after_token: int | None = None) -> torch.Tensor:
    """Labels for teacher forcing on packed blocks: the inputs themselves (the loss shifts them).

    With `ignore_after_token` (the EOS id), the token that follows it, a new document's first token,
    is not a target.
    """
    labels = input_ids.clone()
    if ignore_after_token is not None:
        follows = torch.zeros_like(input_ids, dtype=torch.bool)
        follows[:, 1:] = input_ids[:, :-1] == ignore_after_token
        labels[follows] = IGNORE_INDEX
    return labels


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """Number of positions that have a next-token target (labels are shifted by one)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def causal_lm_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Teacher forcing: position t predicts labels[t+1]; summed in fp32 (or wider) over non-ignored targets."""
    logits = logits[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    targets = labels[:, 1:]
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        label_smoothing=label_smoothing,
    )
