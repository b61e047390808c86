"""Held-out loss, perplexity and bits per byte on a fixed set, reduced as sums across ranks; samples.

Bits per byte (`eval/bpb`) = the summed next-token losses of the held-out set / ln 2 / the UTF-8 bytes of
the text its target tokens encode. Each block's targets are its tokens after the first; their bytes are
those of `tokenizer.decode(targets, skip_special_tokens=True)`, so BOS/EOS/pad count no bytes while the
loss of predicting them still counts (a document's end is information a compressor must store too). A
character split across two blocks decodes as U+FFFD at the cut: a few bytes per block, none for ASCII.
Unlike the loss per token, bpb does not depend on the tokenizer, so runs with different tokenizers compare.

Noise: the held-out set is a sample, so each score has a standard error, `eval/loss_se` and `eval/bpb_se`,
from the blocks' own losses (a ratio estimator over blocks: sum of losses / sum of targets, or bytes); with
`eval/tokens`, the targets scored. Adjacent blocks of one document are not independent, so the error is
a lower bound of the sampling noise; it says nothing of seed-to-seed variation. Each evaluation's
per-block losses also go to `<output_dir>/eval_blocks.jsonl` (main process), from which
scripts/compare_runs.py gives the standard error of a difference between runs scored on the same blocks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmpretrain.model.loss import IGNORE_INDEX, count_targets
from lmpretrain.model.objective import LMObjective
from lmpretrain.observe.tracking import EVAL_BLOCKS


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
    output_dir: Path | None = None
    """`record(step)` appends each evaluation's per-block losses to its EVAL_BLOCKS file (None: nowhere)."""

    def __post_init__(self):
        self.block_bytes = block_bytes(self.blocks, self.tokenizer) if self.tokenizer is not None else None
        self.target_bytes = sum(self.block_bytes) if self.block_bytes is not None else None
        self.last_blocks: dict | None = None  # the last evaluation's per-block losses, targets and bytes

    @torch.no_grad()
    def __call__(self, model) -> dict:
        """Mean next-token loss over all ranks' blocks (sum of losses / sum of targets), perplexity, bpb, the
        standard errors of loss and bpb and the targets scored."""
        acc, objective = self.accelerator, self.objective.held_out()
        model.eval()
        inputs, labels = rank_share(self.blocks, acc.process_index, acc.num_processes)
        total = torch.zeros(2, dtype=torch.float64, device=acc.device)
        others: dict[str, torch.Tensor] = {}  # the objective's other terms: name -> (sum, count)
        rows: list[torch.Tensor] | None = []  # this rank's blocks' (loss sum, targets), padding included
        for start in range(0, len(inputs), self.batch_size):
            x = inputs[start : start + self.batch_size].to(acc.device)
            y = labels[start : start + self.batch_size].to(acc.device)
            with self.precision.autocast():
                terms = objective(model, x, y)
            total[0] += terms["loss"].sum.double()
            total[1] += count_targets(y)
            per_token = terms["loss"].per_token
            if per_token is None:  # a fork's objective that gives no per-token values: no standard errors
                rows = None
            elif rows is not None:
                block_loss = per_token.reshape(len(x), -1).sum(dim=1).double()
                rows.append(torch.stack([block_loss, (y[:, 1:] != IGNORE_INDEX).sum(dim=1).double()], dim=1))
            for name, term in terms.items():
                if name != "loss":
                    others[name] = others.get(name, 0) + torch.stack([term.sum, term.count]).double()
        total = acc.reduce(total, reduction="sum")
        others = {name: acc.reduce(others[name], reduction="sum") for name in sorted(others)}
        blocks = self._in_block_order(acc.gather(torch.cat(rows))) if rows is not None else None
        model.train()
        loss = (total[0] / total[1]).item()
        metrics = {
            "eval/loss": loss,
            "eval/ppl": math.exp(min(loss, 50.0)),
            "eval/tokens": int(total[1].item()),
        }
        metrics.update({f"eval/{name}": (s[0] / s[1].clamp_min(1)).item() for name, s in others.items()})
        if self.target_bytes:
            metrics["eval/bpb"] = total[0].item() / math.log(2) / self.target_bytes
        self.last_blocks = None
        if blocks is not None:
            block_losses, block_targets = blocks[:, 0].tolist(), [int(n) for n in blocks[:, 1].tolist()]
            self.last_blocks = {"loss": block_losses, "targets": block_targets, "bytes": self.block_bytes}
            metrics["eval/loss_se"] = ratio_and_se(block_losses, block_targets)[1]
            if self.block_bytes:
                metrics["eval/bpb_se"] = ratio_and_se(block_losses, self.block_bytes)[1] / math.log(2)
        return metrics

    def _in_block_order(self, gathered: torch.Tensor) -> torch.Tensor:
        """The ranks' rows (rank r's share is blocks r, r + W, ..., then padding) back in block order."""
        world = self.accelerator.num_processes
        per_rank = len(gathered) // world
        order = [(b % world) * per_rank + b // world for b in range(len(self.blocks))]
        return gathered[order].cpu()

    def record(self, step: int) -> None:
        """Append the last evaluation's per-block losses, targets and bytes to `<output_dir>/EVAL_BLOCKS`
        (main process; the Tracker keeps its rows up to a resumed step, like metrics.jsonl's)."""
        if self.output_dir is None or self.last_blocks is None or not self.accelerator.is_main_process:
            return
        with open(Path(self.output_dir) / EVAL_BLOCKS, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **self.last_blocks}) + "\n")


def ratio_and_se(numerators, denominators) -> tuple[float, float]:
    """sum(numerators) / sum(denominators) over k blocks and its standard error (the ratio estimator's
    linearisation: sqrt(k / (k - 1) * sum (x_i - r n_i)^2) / sum n_i); the error is nan for one block."""
    x, n = torch.tensor(numerators, dtype=torch.float64), torch.tensor(denominators, dtype=torch.float64)
    k, total = len(x), n.sum()
    ratio = (x.sum() / total).item()
    if k < 2:
        return ratio, math.nan
    residual = x - ratio * n
    return ratio, (residual.square().sum() * k / (k - 1)).sqrt().item() / total.item()


def evaluate_all(model, step: int, evaluator: Evaluator, tasks, ema=None) -> dict:
    """An evaluation at `step`: the held-out scores, and eval.tasks when due (eval.tasks_every:
    lm-evaluation-harness on the live model, every rank); with an EMA the same scores of the average,
    swapped into the model and back (eval/ema/*)."""
    metrics = evaluator(model)
    evaluator.record(step)  # before the EMA's evaluation replaces the per-block losses
    metrics.update(tasks.run_if_due(model, step))
    if ema:
        metrics.update(ema.evaluate(model, lambda: {**evaluator(model), **tasks.run_if_due(model, step)}))
    return metrics


def block_bytes(blocks: torch.Tensor, tokenizer) -> list[int]:
    """UTF-8 bytes of the text encoded by each block's targets (its tokens after its first), special tokens
    excluded; their sum is the denominator of eval/bpb."""
    return [
        len(tokenizer.decode(row[1:], skip_special_tokens=True, clean_up_tokenization_spaces=False).encode())
        for row in blocks.tolist()
    ]


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
