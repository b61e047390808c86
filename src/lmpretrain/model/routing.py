"""The routing of a mixture of experts: the router's own losses as objective terms, DeepSeek-V3's
aux-loss-free balancing (train.moe_balance), and how the tokens spread over the experts (moe/load_*).

Losses. The load-balancing loss is the model's own: transformers gives each MoE family a
`load_balancing_loss_func` (Switch Transformer's E * sum_e f_e P_e over the router logits of every MoE
layer of one forward) beside its modeling code, and its CausalLM adds it to the loss only when called with
labels. The recipe calls the model without labels (the loss runs inside the objective), so the objective
asks for the router logits (config.output_router_logits) and scores them with that same function, per
micro-batch: the term's sum is the micro-batch's loss times its target count, so the loop's normalisation
(divided by the global batch's target count) averages the micro-batches' losses weighted by their tokens,
across micro-batches and ranks alike. The router z-loss (ST-MoE) is ours: the mean over a micro-batch's
tokens and MoE layers of logsumexp(router logits)^2, normalised the same way.

Loads. A forward pre-hook on every experts module reads the expert ids each token was sent to (the
experts module's integer argument: the routing as it really ran, a selection bias included) into a
[layers, experts] count on the device, with no read to the host. Recomputation (activation checkpointing
runs the forward again inside backward) and evaluation (no grad) are not counted.

Bias balancing (DeepSeek-V3, "auxiliary-loss-free"): after every applied update, each MoE layer's
per-expert selection bias (the router's `e_score_correction_bias`, which picks the experts but does not
weight them) moves by train.moe_bias_rate: up for an expert that received fewer tokens than the layer's
mean in this step (all micro-batches, all ranks), down for one that received more. The bias is a buffer of
the model: checkpoints hold it, so a resumed run goes on with the same biases; the rule keeps no other state.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from lmpretrain.errors import ConfigError
from lmpretrain.model.experts import expert_count, experts_modules, has_experts

BIAS = "e_score_correction_bias"  # transformers' name for DeepSeek-V3-style routers' selection bias


def load_balancing_loss(model_class: type):
    """The model family's own load-balancing loss (`load_balancing_loss_func` in its modeling module), or None.
    Looked up along the class's bases: FSDP2 and forks subclass the model."""
    for cls in model_class.__mro__:
        fn = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
        if fn is not None:
            return fn
    return None


def is_moe(model: nn.Module) -> bool:
    return has_experts(type(model)) and expert_count(model.config) is not None


def router_problems(model: nn.Module, objective) -> list[str]:
    """What train.moe_balance asks of this model that it cannot give; checked on the built model."""
    if not is_moe(model):
        return []
    kind, balance = model.config.model_type, objective.moe_balance
    if balance == "aux_loss" and load_balancing_loss(type(model)) is None:
        return [
            f"train.moe_balance=aux_loss: transformers has no load-balancing loss for {kind}"
            + (
                "; its routers have a selection bias: use train.moe_balance=bias"
                if _biased_routers(model)
                else ""
            )
            + " (or train.moe_balance=none)"
        ]
    if balance == "aux_loss" and objective.router_aux_loss_coef is None:
        if getattr(model.config, "router_aux_loss_coef", None) is None:
            return [
                f"train.moe_balance=aux_loss: {kind}'s config has no router_aux_loss_coef; set train.router_aux_loss_coef"
            ]
    if balance == "bias" and not _biased_routers(model):
        return [
            f"train.moe_balance=bias: {kind}'s routers have no per-expert selection bias ({BIAS}), which "
            "DeepSeek-V3's balancing moves; use train.moe_balance=aux_loss (its load-balancing loss) or a model "
            "whose router has one (deepseek_v3, glm4_moe, dots1, ...)"
        ]
    return []


def install_router_outputs(model: nn.Module, objective) -> list[str]:
    """Ask the model for its router logits where the objective scores them; returns the start-up lines."""
    if not is_moe(model):
        return []
    problems = router_problems(model, objective)
    if problems:
        raise ConfigError(problems)
    lines = []
    if objective.moe_balance == "aux_loss":
        fn = load_balancing_loss(type(model))
        coef = router_aux_weight(model, objective)
        source = (
            "train.router_aux_loss_coef"
            if objective.router_aux_loss_coef is not None
            else "the model config's router_aux_loss_coef"
        )
        lines.append(
            f"experts balanced by the load-balancing loss ({fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}, "
            f"per micro-batch), weight {coef:g} per target token ({source}); logged train/router_aux"
        )
    elif objective.moe_balance == "bias":
        lines.append(
            f"experts balanced without a loss (DeepSeek-V3): after each update every expert's {BIAS} moves by "
            "train.moe_bias_rate toward its layer's mean load"
        )
    else:
        lines.append("experts not balanced (train.moe_balance=none)")
    if objective.router_z_loss:
        lines.append(
            f"router z-loss {objective.router_z_loss:g} x mean(logsumexp(router logits)^2); logged train/router_z"
        )
    if objective.moe_balance == "aux_loss" or objective.router_z_loss:
        model.config.output_router_logits = True
    return lines


def router_aux_weight(model: nn.Module, objective) -> float:
    if objective.router_aux_loss_coef is not None:
        return objective.router_aux_loss_coef
    return float(model.config.router_aux_loss_coef)


def router_terms(model: nn.Module, objective, router_logits, count: torch.Tensor) -> dict:
    """The router's terms of one micro-batch from its router logits (a tuple, one [tokens, experts] tensor per
    MoE layer): name -> (sum, weight); each sum is the micro-batch's mean times `count` (see the module doc)."""
    terms = {}
    if objective.moe_balance == "aux_loss":
        config = model.config
        aux = load_balancing_loss(type(model))(
            router_logits, expert_count(config), config.num_experts_per_tok, None
        )
        terms["router_aux"] = (_wide(aux) * count, router_aux_weight(model, objective))
    if objective.router_z_loss:
        z = torch.stack([torch.logsumexp(_wide(layer), dim=-1).square().mean() for layer in router_logits])
        terms["router_z"] = (z.mean() * count, objective.router_z_loss)
    return terms


def _wide(t: torch.Tensor) -> torch.Tensor:
    """At least float32 (bf16 router logits), float64 kept (the equality tests)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _biased_routers(model: nn.Module) -> list[torch.Tensor]:
    return [getattr(m, BIAS) for m in model.modules() if isinstance(getattr(m, BIAS, None), torch.Tensor)]


class ExpertLoad:
    """Tokens per expert per MoE layer, counted on the device as the experts modules are called; with
    train.moe_balance=bias it also moves the selection biases after each update (see the module doc)."""

    def __init__(self, model: nn.Module, balance: str, bias_rate: float, every: int, accelerator):
        self.layers = experts_modules(model)
        self.experts = expert_count(model.config)
        self.every, self.rate, self.accelerator = every, bias_rate, accelerator
        # each experts module's router bias, in the same order (the router is its sibling in the MoE block)
        self.biases = self._router_biases(model) if balance == "bias" else []
        device = next(model.parameters()).device
        self._step = torch.zeros(len(self.layers), self.experts, dtype=torch.int64, device=device)
        self._window = torch.zeros_like(self._step)  # over every rank; in checkpoints (state_dict)
        self._hooks = [
            m.register_forward_pre_hook(self._counter(i), with_kwargs=True) for i, m in enumerate(self.layers)
        ]

    @classmethod
    def for_run(cls, model: nn.Module, cfg, accelerator) -> ExpertLoad | None:
        """The counts of a run's mixture of experts (its unwrapped model), None for a dense model."""
        if not is_moe(model):
            return None
        return cls(model, cfg.train.moe_balance, cfg.train.moe_bias_rate, cfg.logging.every, accelerator)

    def _router_biases(self, model: nn.Module) -> list[torch.Tensor]:
        parents = {id(c): m for m in model.modules() for c in m.children()}
        biases = []
        for experts in self.layers:
            block = parents[id(experts)]
            found = [
                getattr(c, BIAS) for c in block.children() if isinstance(getattr(c, BIAS, None), torch.Tensor)
            ]
            if len(found) != 1:
                raise ConfigError(
                    [
                        f"train.moe_balance=bias: a {type(block).__name__} has no router with {BIAS} beside its experts"
                    ]
                )
            biases.append(found[0])
        return biases

    def _counter(self, layer: int):
        def count(module, args, kwargs):
            # Not in evaluation (no grad), not in activation checkpointing's recomputation (inside backward).
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return
            ids = next(
                a
                for a in (*args, *kwargs.values())
                if isinstance(a, torch.Tensor) and not a.is_floating_point()
            )
            ids = ids.reshape(-1)
            self._step[layer].index_add_(0, ids, torch.ones_like(ids))

        return count

    def describe(self) -> str:
        return (
            f"expert load: tokens per expert counted in {len(self.layers)} MoE layers of {self.experts} experts, "
            f"logged every {self.every} steps as moe/load_max, moe/load_cv and per-layer histograms moe/load/layer_N "
            "(transformers' experts are dropless: no token is dropped or overflows)"
        )

    def step_done(self, stepped: bool) -> None:
        """After each optimizer step: this step's counts summed over the ranks (one small all-reduce, no read
        to the host) join the window; with bias balancing they move the biases."""
        counts = self.accelerator.reduce(self._step, reduction="sum")
        if self.biases and stepped:
            with torch.no_grad():
                for bias, load in zip(self.biases, counts, strict=True):
                    load = load.to(bias.dtype)
                    bias.add_(self.rate * torch.sign(load.mean() - load))
        self._window += counts
        self._step.zero_()

    def metrics(self, step: int, final: bool) -> dict:
        """Every logging.every steps (and at the last): the window's loads, then a new window."""
        if step % self.every and not final:
            return {}
        window = self._window.double()
        fractions = (window / window.sum(dim=1, keepdim=True).clamp_min(1)).cpu()
        self._window.zero_()
        relative = fractions * self.experts  # 1.0 = an even share of the layer's tokens
        cv = fractions.std(dim=1, correction=0) / fractions.mean(dim=1)
        rows = fractions.tolist()
        return {
            "moe/load_max": relative.max().item(),
            "moe/load_cv": cv.mean().item(),
            **{f"moe/load/layer_{i}": row for i, row in enumerate(rows)},
        }

    def state_dict(self) -> dict:
        """The window's counts so far (the same on every rank): a resumed run logs the loads a straight one does."""
        return {"window": self._window.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self._window.copy_(torch.tensor(state["window"], dtype=self._window.dtype))
