"""A fork of recipes/pretrain.py that adds an entropy regulariser on the logits the loss already has.

    accelerate launch tests/forks/pretrain_entropy.py configs/smoke.yaml --entropy.weight=0.01

`EntropyObjective.logit_terms` names one more term; the base objective computes it on its own fp32 logits
(chunk by chunk with train.loss_impl=chunked), differentiates weight x its sum with the loss, and the loop
logs it as train/entropy and eval/entropy (docs/forking.md).
"""

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))  # a fork in recipes/ needs no line

import pretrain  # noqa: E402

from lmpretrain.model import LMObjective  # noqa: E402


@dataclass
class EntropyConfig:
    weight: float = 0.01
    """Weight of the mean next-token entropy (nats), added to the loss; negative rewards entropy."""


def entropy(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's entropy of the next-token distribution, in nats."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


@dataclass(frozen=True)
class EntropyObjective(LMObjective):
    entropy_weight: float = 0.0

    @classmethod
    def from_config(cls, cfg, eos_token_id):
        return cls(**asdict(LMObjective.from_config(cfg, eos_token_id)), entropy_weight=cfg.entropy.weight)

    def logit_terms(self):
        return {"entropy": (self.entropy_weight, entropy)}


if __name__ == "__main__":
    pretrain.cli(sections={"entropy": EntropyConfig}, objective=EntropyObjective)
