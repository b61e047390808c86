"""Held-out loss, perplexity and bits per byte on a fixed set, reduced as sums across ranks; samples.

Bits per byte (`eval/bpb`) = the summed next-token losses of the held-out set / ln 2 / the UTF-8 bytes of
the text its target tokens encode. Each block's targets are its tokens after the first; their bytes are
those of `tokenizer.decode(targets, skip_special_tokens=True)`, so BOS/EOS/pad count no bytes while the
loss of predicting them still counts (a document's end is information a compressor must store too). A
character split across two blocks decodes as U+FFFD at the cut: a few bytes per block, none for ASCII.
Unlike the loss per token, bpb does not depend on the tokenizer, so runs with different tokenizers compare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from lmpretrain.model.loss import IGNORE_INDEX, count_targets
from lmpretrain.model.objective import LMObjective


def rank_share(blocks: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's blocks (every world_size-th) and their labels, padded so every rank runs the same
    number of forward passes (collectives inside DDP/FSDP forwards must match); padding is ignored."""
    share = blocks[rank::world_size]
    per_rank = -(-len(blocks) // world_size)
    labels = share.clone()
    if len(share) < per_rank:
        pad = blocks[:1].expand(per_rank - len(share), -1)
        share = torch.cat([share, pad])
        labels = torch.cat([labels, torch.full_like(pad, IGNORE_INDEX)])
    return share, labels


@dataclass
class Evaluator:
    """A fixed held-out set and how it is scored: the training objective's forward (same document
    masking and loss kernel) without label smoothing or z-loss, `batch_size` blocks at a time."""

    blocks: torch.Tensor
    objective: LMObjective
    precision: Any
    batch_size: int
    accelerator: Any
    tokenizer: Any = None
    """For eval/bpb; without it only loss and perplexity are reported."""

    def __post_init__(self):
        self.target_bytes = target_bytes(self.blocks, self.tokenizer) if self.tokenizer is not None else None

    @torch.no_grad()
    def __call__(self, model) -> dict:
        """Mean next-token loss over all ranks' blocks (sum of losses / sum of targets), perplexity, bpb."""
        acc, objective = self.accelerator, self.objective.held_out()
        model.eval()
        inputs, labels = rank_share(self.blocks, acc.process_index, acc.num_processes)
        total = torch.zeros(2, dtype=torch.float64, device=acc.device)
        others: dict[str, torch.Tensor] = {}  # the objective's other terms: name -> (sum, count)
        for start in range(0, len(inputs), self.batch_size):
            x = inputs[start : start + self.batch_size].to(acc.device)
            y = labels[start : start + self.batch_size].to(acc.device)
            with self.precision.autocast():
                terms = objective(model, x, y)
            total[0] += terms["loss"].sum.double()
            total[1] += count_targets(y)
            for name, term in terms.items():
                if name != "loss":
                    others[name] = others.get(name, 0) + torch.stack([term.sum, term.count]).double()
        total = acc.reduce(total, reduction="sum")
        others = {name: acc.reduce(others[name], reduction="sum") for name in sorted(others)}
        model.train()
        loss = (total[0] / total[1]).item()
        metrics = {"eval/loss": loss, "eval/ppl": math.exp(min(loss, 50.0))}
        metrics.update({f"eval/{name}": (s[0] / s[1].clamp_min(1)).item() for name, s in others.items()})
        if self.target_bytes:
            metrics["eval/bpb"] = total[0].item() / math.log(2) / self.target_bytes
        return metrics


def evaluate_all(model, step: int, evaluator: Evaluator, tasks, ema=None) -> dict:
    """An evaluation at `step`: the held-out scores, and eval.tasks when due (eval.tasks_every:
    lm-evaluation-harness on the live model, every rank); with an EMA the same scores of the average,
    swapped into the model and back (eval/ema/*)."""
    metrics = evaluator(model)
    metrics.update(tasks.run_if_due(model, step))
    if ema:
        metrics.update(ema.evaluate(model, lambda: {**evaluator(model), **tasks.run_if_due(model, step)}))
    return metrics


def target_bytes(blocks: torch.Tensor, tokenizer) -> int:
    """UTF-8 bytes of the text encoded by the targets of `blocks` (each block's tokens after its first),
    special tokens excluded; the denominator of eval/bpb."""
    return sum(
        len(tokenizer.decode(row[1:], skip_special_tokens=True, clean_up_tokenization_spaces=False).encode())
        for row in blocks.tolist()
    )


@torch.no_grad()
def generate_sample(model, tokenizer, prompt: str, max_new_tokens: int, accelerator) -> str | None:
    """Greedy continuation of ``prompt`` (no RNG consumed, so sampling never changes the training
    trajectory): the text on the main process, None elsewhere. Every rank must call it: a sharded
    model's forward gathers parameters from all ranks, so all of them generate, in lockstep."""
    from lmpretrain.run.runtime import is_sharded

    sharded = is_sharded(model)
    if not (sharded or accelerator.is_main_process):
        return None  # a replica: the main process's own copy is enough
    inner = accelerator.unwrap_model(model)
    was_training = inner.training
    inner.eval()
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(accelerator.device)
    # No further than the model's positions: past them a learned position embedding (GPT-2) has no row
    # (an IndexError after the whole training), and the model never trained there anyway.
    limit = getattr(inner.config, "max_position_embeddings", None)
    if limit is not None:
        max_new_tokens = max(0, min(max_new_tokens, limit - ids.size(1)))
    out = inner.generate(
        ids,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
        # Ranks keep forwarding until every rank is done, so an early stop on one cannot strand the
        # others in a parameter all-gather.
        synced_gpus=sharded and accelerator.num_processes > 1,
    )
    inner.train(was_training)
    return tokenizer.decode(out[0], skip_special_tokens=True) if accelerator.is_main_process else None
