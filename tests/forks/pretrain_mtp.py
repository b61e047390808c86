"""A fork of recipes/pretrain.py that adds a multi-token-prediction (MTP) term, as new files only.

    accelerate launch tests/forks/pretrain_mtp.py configs/smoke.yaml --mtp.weight=0.3

Three things, none of them an edit of the library or the recipe (docs/forking.md shows this file whole):
- `MTPConfig`, a config section of its own: `--mtp.weight=...` on the command line, type-checked, saved in
  config.yaml and W&B;
- `MTPObjective`, the recipe's objective plus a term `mtp`: position t also predicts token t+2, from the
  final hidden state the model computed once, through a small extra projection and the shared output
  embedding, scored like the next-token loss (train.loss_impl, label smoothing, z-loss). The loop reduces,
  weights and logs it (`train/mtp`, and on the console line) like the built-in terms;
- the projection is marked `auxiliary`: trained and checkpointed, left out of `final/`, which loads as the
  plain model class; its weights and the second pass through the output embedding count in FLOPs and MFU.
"""

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))  # a fork in recipes/ needs no line

import pretrain  # noqa: E402  (the recipe: its cli() takes a fork's sections and objective)

from lmpretrain.checkpoint import auxiliary  # noqa: E402
from lmpretrain.model import IGNORE_INDEX, LMObjective, Term  # noqa: E402


@dataclass
class MTPConfig:
    weight: float = 0.1
    """Weight of the t+2 prediction term (per target token, like the loss)."""


def skip_one(targets: torch.Tensor) -> torch.Tensor:
    """What position t predicts two tokens ahead: the next-token target of position t+1."""
    ahead = torch.full_like(targets, IGNORE_INDEX)
    ahead[:, :-1] = targets[:, 1:]
    return ahead


@dataclass(frozen=True)
class MTPObjective(LMObjective):
    mtp_weight: float = 0.0

    @classmethod
    def from_config(cls, cfg, eos_token_id):  # the objective reads its settings from the config
        return cls(**asdict(LMObjective.from_config(cfg, eos_token_id)), mtp_weight=cfg.mtp.weight)

    def install(self, model):  # before the optimizer and the wrapping: the projection trains
        width = model.config.hidden_size
        model.mtp_proj = auxiliary(nn.Linear(width, width, bias=False, dtype=model.dtype))
        return [*super().install(model), f"mtp: t+2 term, weight {self.mtp_weight:g}"]

    def terms(self, model, out, targets):  # inside the model's forward; `out`: what the model computed
        terms = super().terms(model, out, targets)  # loss (and z_loss), as the recipe computes them
        ahead = skip_one(targets)
        mtp = self.token_loss(model, model.mtp_proj(out.hidden), ahead)
        terms["mtp"] = Term(mtp.objective, (ahead != IGNORE_INDEX).sum(), self.mtp_weight)
        return terms

    def extra_matmul_params(self, model):  # FLOPs: mtp_proj, and the output embedding once more
        return super().extra_matmul_params(model) + model.get_output_embeddings().weight.numel()


if __name__ == "__main__":
    pretrain.cli(sections={"mtp": MTPConfig}, objective=MTPObjective)
