"""Causal LM loss as token *sums*, so the recipe can divide by the global number of targets.

Averaging per-micro-batch means weights a micro-batch with few kept tokens as much as a full one;
summing here and normalising once by the count over all micro-batches and ranks makes gradient
accumulation and data parallelism equal one big batch.

Three implementations of the same sums (`train.loss_impl`): `full` from the model's logits;
`chunked` from the final hidden states through the output embedding, a chunk of rows at a time,
never holding the logits of the whole micro-batch; `liger` with Liger's fused kernel (CUDA).
Each also sums the z-loss term logsumexp(logits)^2 over the targets (OLMo's stabiliser).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""A label or target with this value is not scored (a document's first token, padding)."""


class LossSums(NamedTuple):
    """Token sums over a micro-batch's targets (a NamedTuple so DDP/FSDP walk it like a tuple).

    `objective` (= ce + z_loss * z + the weighted logit terms) is what backward runs on; `ce`, `z` and
    `extra` (the sums of the logit terms, in their order) are detached, for logging. `tokens`: each
    target's cross-entropy (detached, shaped like the targets, 0 where ignored) when asked for, else None.
    """

    objective: torch.Tensor
    ce: torch.Tensor
    z: torch.Tensor
    extra: tuple = ()
    tokens: torch.Tensor | None = None


def _logit_term_sums(logits, targets, keep, logit_terms) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """(weighted sum of the terms, to differentiate; each term's sum) of `logit_terms` [(weight, fn)] over
    rows (logits [N, V], targets [N] with ignored rows set to 0, keep [N]): fn gives one value per row,
    summed over the rows that have a target."""
    weighted, sums = None, []
    for weight, fn in logit_terms:
        value = torch.where(keep, fn(logits, targets, keep), 0).sum()
        sums.append(value.detach())
        if weight:
            weighted = weight * value if weighted is None else weighted + weight * value
    return weighted, sums


def make_labels(input_ids: torch.Tensor, ignore_after_token: int | None = None) -> torch.Tensor:
    """Labels for teacher forcing on packed blocks: the inputs themselves (the loss shifts them).

    With `ignore_after_token` (the EOS id), the token that follows it, a new document's first token,
    is not a target.
    """
    labels = input_ids.clone()
    if ignore_after_token is not None:
        follows = torch.zeros_like(input_ids, dtype=torch.bool)
        follows[:, 1:] = input_ids[:, :-1] == ignore_after_token
        labels = torch.where(follows, IGNORE_INDEX, labels)  # not labels[follows] = ...: no host wait
    return labels


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """Number of positions that have a next-token target (labels are shifted by one)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """targets[:, t] = labels[:, t + 1]: what position t predicts; the last position has none."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return targets


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32, or float64 for float64 runs


def logits_loss_sums(
    logits: torch.Tensor,
    targets: torch.Tensor,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_terms=(),
    per_token: bool = False,
) -> LossSums:
    """`full`: sums from logits (..., V) aligned with `targets` (...), in fp32 (or wider); `logit_terms`:
    [(weight, fn)] of LMObjective.logit_terms, computed on the same fp32 logits; `per_token`: also each
    target's cross-entropy (`LossSums.tokens`)."""
    shape = targets.shape
    logits = logits.reshape(-1, logits.size(-1))
    logits = logits.to(_accumulation_dtype(logits.dtype))
    targets = targets.reshape(-1)
    tokens = None
    if per_token:
        rows = F.cross_entropy(
            logits, targets, ignore_index=IGNORE_INDEX, reduction="none", label_smoothing=label_smoothing
        )
        ce, tokens = rows.sum(), rows.detach().reshape(shape)
    else:
        ce = F.cross_entropy(
            logits, targets, ignore_index=IGNORE_INDEX, reduction="sum", label_smoothing=label_smoothing
        )
    z = logits.new_zeros(())
    if z_loss:  # masked, not selected: boolean indexing would make the host wait for the GPU
        z = (torch.logsumexp(logits, dim=-1).square() * (targets != IGNORE_INDEX)).sum()
    objective = ce + z_loss * z if z_loss else ce
    if not logit_terms:
        return LossSums(objective, ce.detach(), z.detach(), (), tokens)
    keep = targets != IGNORE_INDEX
    weighted, sums = _logit_term_sums(logits, torch.where(keep, targets, 0), keep, logit_terms)
    objective = objective if weighted is None else objective + weighted
    return LossSums(objective, ce.detach(), z.detach(), tuple(sums), tokens)


def causal_lm_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Teacher forcing: position t predicts labels[t+1]; summed in fp32 (or wider) over non-ignored targets."""
    return logits_loss_sums(logits, next_token_targets(labels), label_smoothing).objective


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the output projection runs in: autocast's when it is on (as nn.Linear would), else the weight's."""
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Cross-entropy (+ z-loss) of `hidden @ weight.T + bias`, `chunk` rows at a time.

    The gradients are computed chunk by chunk in the forward pass (only one chunk's logits ever exist)
    and scaled in backward; the objective is linear in them, so nothing is recomputed.
    d/dlogits of ce + w * lse^2 = softmax * (1 + 2 w lse) - (1 - s) onehot(target) - s / V.
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        targets,
        chunk: int,
        label_smoothing: float,
        z_loss: float,
        grad_enabled: bool,
        logit_terms: tuple,
    ):
        dtype = _compute_dtype(weight)
        acc = _accumulation_dtype(dtype)
        vocab = weight.size(0)
        w = weight.to(dtype)
        # fp16 gradients computed here are not loss-scaled yet (backward scales them): they stay fp32 so
        # small ones do not underflow. bf16 has fp32's range and keeps the fast matmuls.
        grad_dtype = acc if dtype == torch.float16 else dtype
        w_grad = w if grad_dtype == dtype else weight.to(grad_dtype)
        b = bias.to(dtype) if bias is not None else None
        # needs_input_grad follows requires_grad, not grad mode (torch 2.13: True under no_grad), so
        # evaluation would build the hidden and weight gradients (3x the matmuls, a vocab x hidden fp32
        # buffer); autograd.Function.forward itself runs with grad mode off, so the caller's is passed in.
        want_grad = grad_enabled and any(ctx.needs_input_grad[:3])
        ce = torch.zeros((), dtype=acc, device=hidden.device)
        z = torch.zeros((), dtype=acc, device=hidden.device)
        extra = torch.zeros(len(logit_terms), dtype=acc, device=hidden.device)  # the logit terms' sums
        extra_objective = torch.zeros((), dtype=acc, device=hidden.device)  # their weighted sum
        tokens = torch.zeros(hidden.size(0), dtype=acc, device=hidden.device)  # each row's cross-entropy
        grad_hidden = None
        if want_grad:
            grad_hidden = torch.empty(
                hidden.shape, dtype=torch.promote_types(hidden.dtype, grad_dtype), device=hidden.device
            )
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_grad else None
        grad_bias = (
            torch.zeros(vocab, dtype=acc, device=weight.device) if want_grad and b is not None else None
        )
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are chosen above, as autocast would
            for start in range(0, hidden.size(0), chunk):
                h = hidden[start : start + chunk].to(dtype)
                y = targets[start : start + chunk]
                keep = y != IGNORE_INDEX  # a row without a target adds nothing and gets no gradient
                y = torch.where(keep, y, 0)
                # One pass over the chunk's logits, in place: shift by the row max, exponentiate, normalise.
                logits = F.linear(h, w, b).to(acc)
                extra_grad = None
                if logit_terms:  # a fork's terms on these logits, differentiated before the in-place ops
                    with torch.enable_grad():
                        leaf = logits.detach().requires_grad_(want_grad)
                        weighted, sums = _logit_term_sums(leaf, y, keep, logit_terms)
                        if want_grad and weighted is not None and weighted.requires_grad:
                            (extra_grad,) = torch.autograd.grad(weighted, leaf)
                    extra += torch.stack(sums).to(acc)
                    if weighted is not None:
                        extra_objective += weighted.detach()
                row_max = logits.amax(dim=-1)
                logits.sub_(row_max[:, None])
                rows = -logits.gather(1, y[:, None]).squeeze(1)  # - shifted target logit
                if label_smoothing:
                    rows = (1 - label_smoothing) * rows - label_smoothing * logits.mean(dim=-1)
                total = logits.exp_().sum(dim=-1)
                shifted_lse = total.log()
                row_ce = (rows + shifted_lse) * keep  # logsumexp - target logit (smoothed), the max cancels
                tokens[start : start + chunk] = row_ce
                ce += row_ce.sum()
                lse = shifted_lse + row_max
                z += (lse.square() * keep).sum()
                if not want_grad:
                    continue
                grad = logits.div_(total[:, None])  # softmax
                if z_loss:
                    grad.mul_((1 + 2 * z_loss * lse)[:, None])
                grad[torch.arange(len(y), device=y.device), y] -= 1 - label_smoothing
                if label_smoothing:
                    grad.sub_(label_smoothing / vocab)
                grad.mul_(keep[:, None])
                if extra_grad is not None:
                    grad.add_(extra_grad)
                grad = grad.to(grad_dtype)
                grad_hidden[start : start + chunk] = grad @ w_grad
                grad_weight += (grad.T @ hidden[start : start + chunk].to(grad_dtype)).to(acc)
                if grad_bias is not None:
                    grad_bias += grad.sum(0).to(acc)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        objective = ce + z_loss * z if z_loss else ce.clone()
        objective += extra_objective
        z = z if z_loss else torch.zeros_like(z)  # as `full` reports: no z term, no z sum
        ctx.mark_non_differentiable(ce, z, extra, tokens)
        return objective, ce, z, extra, tokens

    @staticmethod
    def backward(ctx, grad_objective, _grad_ce, _grad_z, _grad_extra, _grad_tokens):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
        scale = grad_objective.to(grad_weight.dtype)
        grads = [
            (grad_hidden * scale.to(grad_hidden.dtype)).to(hidden_dtype) if ctx.needs_input_grad[0] else None,
            (grad_weight * scale).to(weight_dtype) if ctx.needs_input_grad[1] else None,
            (grad_bias * scale).to(bias_dtype) if ctx.needs_input_grad[2] else None,
        ]
        return (*grads, None, None, None, None, None, None)


def chunked_loss_sums(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    chunk_tokens: int,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_terms=(),
) -> LossSums:
    """`chunked`: the sums of `logits_loss_sums(hidden @ weight.T + bias, targets)`, with at most
    `chunk_tokens` rows of logits alive at once (`tokens`: each target's cross-entropy, always given: the
    chunks compute it anyway). Rows without a target are projected too and masked: selecting the others
    (`hidden[targets != -100]`) would make the host wait for the GPU (a nonzero) in every micro-batch, for
    a saving of about one row per sequence."""
    objective, ce, z, extra, tokens = _ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.size(-1)),
        weight,
        bias,
        targets.reshape(-1),
        chunk_tokens,
        label_smoothing,
        z_loss,
        torch.is_grad_enabled(),
        tuple(logit_terms),
    )
    extra = tuple(extra.unbind()) if logit_terms else ()
    return LossSums(objective, ce, z, extra, tokens.reshape(targets.shape))


def liger_loss_sums(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> LossSums:
    """`liger`: Liger's fused linear cross-entropy (Triton, CUDA only); its loss includes the z term."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    out = liger_fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.size(-1)),
        weight,
        targets.reshape(-1),
        bias,
        **liger_arguments(label_smoothing, z_loss),
    )
    loss, z_term = liger_outputs(out)
    z_term = z_term if z_term is not None else torch.zeros_like(loss)
    z = (z_term / z_loss).detach() if z_loss else torch.zeros_like(loss)
    return LossSums(loss, (loss - z_term).detach(), z)


def liger_arguments(label_smoothing: float, z_loss: float) -> dict:
    """The keyword arguments we pass to `liger_fused_linear_cross_entropy` (the same in 0.5.10 to 0.8.5)."""
    return {
        "ignore_index": IGNORE_INDEX,
        "lse_square_scale": z_loss,
        "label_smoothing": label_smoothing,
        "reduction": "sum",
        "return_z_loss": True,
    }


def liger_outputs(out) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss, z term) from what Liger returns with return_z_loss=True: a `(loss, z_loss)` tuple up to
    liger-kernel 0.6.2, a `CrossEntropyOutput` dataclass (fields loss, z_loss, ...) in 0.8.x."""
    if isinstance(out, tuple):
        loss, z_term = out
        return loss, z_term
    return out.loss, out.z_loss
