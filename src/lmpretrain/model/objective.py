"""What the model is trained on: one forward + loss for training and evaluation, as named terms.

The recipe's micro-batch loop and the `Evaluator` both call `objective(model, input_ids, labels)`, which
returns named terms, name -> `Term(sum, count, weight)`: `loss` (cross-entropy), with train.z_loss
`z_loss`, and for a mixture of experts the router's `router_aux` (its load-balancing loss) and `router_z`
(model/routing.py). The loop reduces each term over micro-batches and ranks, adds weight * sum / (the global
batch's target count) to what it differentiates, and logs sum / count as `train/<name>` (and
`eval/<name>` at evaluation).

One place runs the model: `run_model` calls it once per micro-batch and returns a `Forward` (the final
hidden states, the logits when the loss needs them, the base model's own output object); `terms(model,
out, targets)` computes every term from it. A fork adds a term from the logits the loss already computes
by overriding `logit_terms()`, or any term by overriding `terms()` and reading `out` (an auxiliary head on
`out.hidden`, scored by `token_loss` with this run's loss_impl, label smoothing and z-loss): the model never
runs twice (docs/forking.md).

The loss runs inside the model's own forward (`install`, called by the recipe): under FSDP2 the output
embedding is gathered only during the root module's forward, and DDP/DeepSpeed see an ordinary call.
Called without `lm_targets`, the model behaves as before (generation, pipelines).

Document masking: a new document starts after each EOS (the data pipeline guarantees EOS ends every
document). Positions restart at each document, and transformers turns restarting `position_ids`
into a block-causal mask (sdpa, eager, flex_attention) or flash-attention's variable-length path,
which reads documents from the positions of a single row (so the micro-batch becomes one row).
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from lmpretrain.errors import ConfigError
from lmpretrain.model.loss import (
    IGNORE_INDEX,
    LossSums,
    chunked_loss_sums,
    liger_loss_sums,
    logits_loss_sums,
    next_token_targets,
)
from lmpretrain.model.routing import install_router_outputs, router_terms


def document_positions(input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Position of each token within its document: 0 at each row start and after each EOS."""
    index = torch.arange(input_ids.size(1), device=input_ids.device).expand_as(input_ids)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = input_ids[:, :-1] == eos_token_id
    return index - torch.where(starts, index, 0).cummax(dim=1).values


class Term(NamedTuple):
    """One named part of the objective over a micro-batch (a NamedTuple: DDP/FSDP walk it like a tuple).

    `sum` over `count` units (the targets it scores); the loop differentiates weight * sum divided by
    the global batch's target count, so weights are per target token, and logs sum / count. A term
    with weight 0 is logged only. `per_token`: its value at each target position (detached, shaped like
    the targets, 0 where there is none), when the objective was asked for it (`per_token=True`).
    """

    sum: torch.Tensor
    count: torch.Tensor
    weight: float
    per_token: torch.Tensor | None = None


class Forward(NamedTuple):
    """What the model computed for a micro-batch, once (`LMObjective.run_model`); every term reads it.

    `hidden`: the final hidden states [batch, seq, hidden_size] (after the final norm: the output
    embedding's input). `logits`: the model's own logits with loss_impl=full, None otherwise (the chunked
    and Liger losses never form them). `output`: the base model's output object (`model.base_model(...)`),
    e.g. a mixture of experts' `router_logits` when the model is asked for them (`model_inputs`).
    `hidden` and `output` are None for a model without a separate base model (loss_impl=full only).
    """

    hidden: torch.Tensor | None
    logits: torch.Tensor | None
    output: Any


def weighted_sum(terms: dict[str, Term]) -> torch.Tensor:
    """What backward runs on, before normalisation: the sum of weight x sum over the weighted terms."""
    return sum(term.weight * term.sum for term in terms.values() if term.weight)


@dataclass(frozen=True)
class LMObjective:
    """What a micro-batch is trained on (from `train.*` and `data.document_masking`); call it on a batch."""

    loss_impl: str = "full"
    chunk_tokens: int = 2048
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    document_masking: bool = False
    eos_token_id: int | None = None
    single_row: bool = False
    """flash-attention: pack the micro-batch into one row, where its varlen kernel sees the documents."""
    moe_balance: str = "aux_loss"
    """A mixture of experts' balancing (train.moe_balance); aux_loss adds the `router_aux` term."""
    router_aux_loss_coef: float | None = None
    router_z_loss: float = 0.0
    per_token: bool = False
    """Also return `loss`'s value at each target position (`Term.per_token`): the evaluator's per-block
    losses. Liger's fused kernel gives no per-token values."""

    @classmethod
    def from_config(cls, cfg, eos_token_id: int) -> LMObjective:
        return cls(
            loss_impl=cfg.train.loss_impl,
            chunk_tokens=cfg.train.loss_chunk_tokens,
            label_smoothing=cfg.train.label_smoothing,
            z_loss=cfg.train.z_loss,
            moe_balance=cfg.train.moe_balance,
            router_aux_loss_coef=cfg.train.router_aux_loss_coef,
            router_z_loss=cfg.train.router_z_loss,
            document_masking=cfg.data.document_masking,
            eos_token_id=eos_token_id,
            single_row=cfg.data.document_masking and cfg.model.attn_implementation.startswith("flash"),
        )

    def logit_terms(self) -> dict:
        """The hook for a fork's terms on the logits the base loss computes: name -> (weight, fn), where
        fn(logits [rows, vocab] fp32, targets [rows] (0 where ignored), mask [rows] bool) returns one value
        per row; the term is its sum over the rows with a target, differentiated with weight (per target
        token, like `loss`), logged as train/<name> and eval/<name>. None here."""
        return {}

    def held_out(self) -> LMObjective:
        """The same forward for evaluation, scoring plain cross-entropy (no smoothing, no z-loss) per token
        (the per-block losses of eval/loss_se); the logit terms are computed too, for eval/<name>. Liger's
        loss gives no per-token values: the held-out set is scored with the chunked loss (the same sums)."""
        loss_impl = "chunked" if self.loss_impl == "liger" else self.loss_impl
        return replace(self, label_smoothing=0.0, z_loss=0.0, per_token=True, loss_impl=loss_impl)

    def describe(self) -> str:
        loss = {
            "full": "full (logits of the whole micro-batch, fp32 cross-entropy)",
            "chunked": f"chunked ({self.chunk_tokens} tokens of logits at a time, from the final hidden states)",
            "liger": "liger (Liger's fused linear cross-entropy)",
        }[self.loss_impl]
        masking = "off (attention spans the whole packed block)"
        if self.document_masking:
            layout = "one row per micro-batch, varlen" if self.single_row else "block-causal mask"
            masking = f"on (positions restart after each EOS; {layout})"
        z = f"; z-loss {self.z_loss:g} x mean(logsumexp^2)" if self.z_loss else ""
        return f"loss: {loss}{z}; document masking: {masking}"

    def model_inputs(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
        """The keyword arguments of the model call for this batch (targets included)."""
        targets = next_token_targets(labels)
        inputs = {"input_ids": input_ids}
        if self.document_masking:
            inputs["position_ids"] = document_positions(input_ids, self.eos_token_id)
        if self.single_row:
            inputs = {k: v.reshape(1, -1) for k, v in inputs.items()}
            targets = targets.reshape(1, -1)  # each row's last target is already ignored
        # No KV cache: transformers reads documents from position_ids only when there is none.
        return {**inputs, "use_cache": False, "lm_targets": targets, "lm_objective": self}

    def __call__(self, model, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Term]:
        """Forward + named terms of one micro-batch through `model` (wrapped or not)."""
        return model(**self.model_inputs(input_ids, labels))

    def install(self, model) -> list[str]:
        """Let the model compute this objective inside its own forward, then show on a few tokens that it
        can (check_objective); returns the log lines. Before accelerate wraps the model."""
        extra = self.logit_terms()
        if extra and self.loss_impl == "liger":
            raise ConfigError(
                [
                    f"the objective's logit terms ({', '.join(extra)}) need the logits, which train.loss_impl=liger "
                    "never forms; use train.loss_impl=chunked (they are computed chunk by chunk) or full"
                ]
            )
        install_loss_forward(model)
        routing = install_router_outputs(model, self)  # a mixture of experts' router terms
        terms = (
            [f"logit terms: {', '.join(f'{n} (weight {w:g})' for n, (w, _) in extra.items())}"]
            if extra
            else []
        )
        return [self.describe(), *routing, *terms, *check_objective(model, self)]

    def run_model(self, model, forward, **inputs) -> Forward:
        """The one call of the model for a micro-batch (inside its forward): the base model for the chunked
        and Liger losses; with loss_impl=full the model's own forward (its logits keep any post-processing,
        e.g. soft-capping), the base model's output taken on the way. `forward` is the class's forward."""
        base = model.base_model
        if self.loss_impl != "full":
            output = base(**inputs)
            return Forward(output.last_hidden_state, None, output)
        seen = []
        hook = base.register_forward_hook(lambda module, args, output: seen.append(output))
        try:
            logits = forward(model, **inputs).logits
        finally:
            hook.remove()
        output = seen[-1] if seen and base is not model else None  # no separate base: nothing to take
        return Forward(getattr(output, "last_hidden_state", None), logits, output)

    def terms(self, model, out: Forward, targets: torch.Tensor) -> dict[str, Term]:
        """Inside the model's forward, after `run_model`: the named terms of `targets` from `out`. Override
        to add terms (keep `loss`): call this one and add to its dict."""
        extra = self.logit_terms()
        sums = self._loss_sums(model, out.hidden, targets, out.logits, list(extra.values()))
        count = (targets != IGNORE_INDEX).sum()
        per_token = sums.tokens if self.per_token else None
        router_logits = getattr(out.output, "router_logits", None)  # a mixture of experts asked for them
        routing = router_terms(model, self, router_logits, count) if router_logits else {}
        routing = {name: Term(value, count, weight) for name, (value, weight) in routing.items()}
        if not self.z_loss and not extra:
            return {"loss": Term(sums.objective, count, 1.0, per_token), **routing}
        # The loss implementations differentiate ce + z_loss * z + the weighted logit terms as one sum (the
        # chunked loss computes its gradient in the forward); `loss` carries that gradient with the value
        # ce, the other terms their values only.
        carry = sums.objective - sums.objective.detach()
        terms = {"loss": Term(sums.ce + carry, count, 1.0, per_token)}
        if self.z_loss:
            terms["z_loss"] = Term(sums.z, count, self.z_loss)
        for (name, (weight, _)), value in zip(extra.items(), sums.extra, strict=True):
            terms[name] = Term(value, count, weight)
        return {**terms, **routing}

    def token_loss(self, model, hidden: torch.Tensor, targets: torch.Tensor) -> LossSums:
        """The loss of `targets` ([batch, seq], IGNORE_INDEX where none) predicted from `hidden` through the
        model's output embedding, as this run computes its own: train.loss_impl, label smoothing, z-loss
        (not the logit terms, which belong to the next-token loss). For a fork's auxiliary head; sums over
        the targets: `.objective` is what to differentiate."""
        return self._loss_sums(model, hidden, targets, None, [])

    def _loss_sums(self, model, hidden, targets, logits, extra) -> LossSums:
        if self.loss_impl == "full":
            if logits is None:
                logits = model.get_output_embeddings()(hidden)
            return logits_loss_sums(
                logits, targets, self.label_smoothing, self.z_loss, extra, per_token=self.per_token
            )
        head = model.get_output_embeddings()
        if self.loss_impl == "chunked":
            return chunked_loss_sums(
                hidden,
                head.weight,
                head.bias,
                targets,
                chunk_tokens=self.chunk_tokens,
                label_smoothing=self.label_smoothing,
                z_loss=self.z_loss,
                logit_terms=extra,
            )
        return liger_loss_sums(
            hidden, head.weight, head.bias, targets, label_smoothing=self.label_smoothing, z_loss=self.z_loss
        )

    def extra_matmul_params(self, model) -> int:
        """Weights this objective uses as matmuls per token beyond the model's own forward, for FLOPs and
        MFU (6 FLOPs per weight per token): every auxiliary module's (checkpoint.auxiliary) 2-D and larger
        weights. A fork that runs a weight of the model once more per token (a second pass through the
        output embedding) adds it in an override."""
        from lmpretrain.checkpoint.export import auxiliary_prefixes

        prefixes = auxiliary_prefixes(model)
        return sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and n.startswith(prefixes))


def _forward_with_loss(self, *args, lm_targets=None, lm_objective=None, **kwargs):
    """The model's forward; with `lm_targets` it returns `lm_objective`'s loss sums instead of logits."""
    forward = type(self).forward
    if lm_targets is None:
        # Generation and other plain calls run eager: compiled blocks (train.compile) are specialised for
        # the training and eval shapes, and a growing KV cache would recompile them at every length.
        with torch.compiler.set_stance("force_eager"):
            return forward(self, *args, **kwargs)
    return lm_objective.terms(self, lm_objective.run_model(self, forward, **kwargs), lm_targets)


def install_loss_forward(model) -> None:
    """Let `model(..., lm_targets=, lm_objective=)` compute the loss sums inside the model's forward."""
    model.forward = types.MethodType(_forward_with_loss, model)


# ---- start-up checks: what the model really does with this objective, shown on a few tokens ----------


@contextmanager
def _kernel_that_runs_here(model):
    """Flash attention cannot run before the model reaches its GPU: check with sdpa meanwhile (same masks)."""
    kernel = model.config._attn_implementation
    device = next(model.parameters()).device
    if not (kernel.startswith("flash") and device.type == "cpu"):
        yield kernel
        return
    model.config._attn_implementation = "sdpa"
    try:
        yield f"sdpa standing in for {kernel} on the CPU before the model moves"
    finally:
        model.config._attn_implementation = kernel


def _relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _sample_documents(vocab: int, eos: int, lengths=(5, 9, 6)) -> list[torch.Tensor]:
    """Token ids from a private generator (training's RNG stream is untouched), each ending with EOS."""
    gen = torch.Generator().manual_seed(0)
    docs = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=gen)
        ids[ids == eos] = (eos + 1) % vocab
        ids[-1] = eos
        docs.append(ids)
    return docs


@torch.no_grad()
def check_objective(model, objective: LMObjective, tolerance: float = 1e-4) -> list[str]:
    """Refuse (ConfigError) what this model cannot do with `objective`, shown on a few tokens before any
    training: chunked/liger losses on models that post-process their logits (soft-capping, scaling),
    and document masking on models or kernels that let attention cross documents. Returns log lines."""
    if objective.loss_impl == "full" and not objective.document_masking:
        return []
    params = list(model.parameters())
    if any(p.is_meta for p in params):  # built on meta (meta init, FSDP's rank-0 loading): no values yet
        with torch.device("cpu"):  # inside the meta build's device context
            return [*check_objective(_host_twin(model, objective), objective, tolerance), _TWIN]
    device, vocab = params[0].device, model.config.vocab_size
    kind = model.config.model_type
    lines = []
    was_training = model.training
    model.eval()
    try:
        with _kernel_that_runs_here(model) as kernel:
            if objective.loss_impl != "full":
                lines.append(_check_logits_from_hidden(model, objective, kind, vocab, device))
            if objective.document_masking:
                lines.append(
                    _check_document_masking(model, objective, kind, kernel, vocab, device, tolerance)
                )
    finally:
        model.train(was_training)
    return lines


_TWIN = (
    "objective checks run on a host twin of the model built on meta (one decoder layer of each layer type)"
)


def _host_twin(model, objective: LMObjective):
    """The model's class and config on the CPU with one decoder layer of each layer type, from a fixed seed
    that leaves the global generator as it was (a meta build replays its draws): what the checks look at is
    the model's kind, kernels and post-processing, not its size or weights."""
    import copy

    config = copy.deepcopy(model.config)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        first = sorted({t: i for i, t in reversed(list(enumerate(layer_types)))}.values())
        config.layer_types = [layer_types[i] for i in first]
    config.num_hidden_layers = len(config.layer_types) if layer_types else 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        twin = type(model)._from_config(config).to(model.dtype)
    install_loss_forward(twin)
    install_router_outputs(twin, objective)
    return twin


def _check_logits_from_hidden(model, objective, kind, vocab, device) -> str:
    base, head = model.base_model, model.get_output_embeddings()
    if base is model or head is None or not hasattr(head, "weight"):
        raise ConfigError(
            [
                f"train.loss_impl={objective.loss_impl}: a {kind} model has no separate base model and output "
                f"embedding to compute the loss from; use train.loss_impl=full"
            ]
        )
    ids = torch.randint(0, vocab, (1, 12), generator=torch.Generator().manual_seed(1)).to(device)
    logits = type(model).forward(model, input_ids=ids).logits
    projected = head(base(input_ids=ids).last_hidden_state)
    difference = _relative_difference(projected.double(), logits.double())
    if difference > 1e-7:  # the same ops give the same bits; soft-capping at init already differs ~1e-5
        raise ConfigError(
            [
                f"train.loss_impl={objective.loss_impl}: a {kind} model post-processes its logits after the output "
                f"embedding (soft-capping or scaling: relative difference {difference:.2g}), which the "
                f"{objective.loss_impl} loss does not reproduce; use train.loss_impl=full"
            ]
        )
    return f"{objective.loss_impl} loss: logits = output embedding(final hidden states) for {kind}, checked"


def _check_document_masking(model, objective, kind, kernel, vocab, device, tolerance) -> str:
    """Per-document loss sums of a block packing three documents = those documents run alone."""
    docs = [d.to(device) for d in _sample_documents(vocab, objective.eos_token_id)]
    packed = torch.cat(docs)[None]
    plain = objective.held_out()
    worst = 0.0
    start = 0
    for doc in docs:
        alone = plain(model, doc[None], doc[None])["loss"].sum  # the document's own next-token targets
        labels = torch.full_like(packed, IGNORE_INDEX)
        labels[0, start + 1 : start + len(doc)] = doc[1:]
        inside = plain(model, packed, labels)["loss"].sum
        worst = max(worst, abs(inside.item() - alone.item()) / abs(alone.item()))
        start += len(doc)
    if worst > tolerance:
        raise ConfigError(
            [
                f"data.document_masking=true: with model.attn_implementation={model.config._attn_implementation} "
                f"a {kind} model lets attention or positions cross document boundaries (a packed document's loss "
                f"differs from the document alone by {worst:.2g} relative): it cannot mask documents through "
                f"position_ids. Use another attention kernel (sdpa, flex_attention) or data.document_masking=false"
            ]
        )
    return f"document masking: packed documents = documents alone for {kind} with {kernel} (relative {worst:.1e})"
