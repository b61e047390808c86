"""Expert parallelism (model.ep_size): each MoE layer's experts split over ep_size ranks, every token sent
to the ranks of its experts and back by all-to-all, composed with the recipe's FSDP2 / HSDP launch.

Through transformers' own pieces: `DistributedConfig(ep_size, ep_implementation="all_to_all")` describes
the layout, `initialize_distributed_mesh` builds its two views of the ranks (dense: replicas x shards;
experts: replicas x efsdp x ep, efsdp = shards / ep), the model's `base_model_ep_plan` is resolved and
applied by `apply_expert_parallelism` (expert stacks sharded on dim 0 over the ep group, the experts'
forward replaced by `AllToAllEP`'s dispatch and combine). What `from_pretrained(distributed_config=...)`
does next, `apply_fully_sharded_data_parallelism`, would shard the whole model itself; here the experts
are sharded over efsdp (and replicated over the replica groups) and accelerate's FSDP2 then wraps the rest
with the launch's own plugin, policy and mesh. Two things of that path are bridged (docs/moe.md):

* the expert gradients: transformers sets FSDP2's divide factor to the data-parallel size, which torch
  2.13 applies twice when the expert FSDP group has one rank and the reduction runs in float64 or float16
  (`foreach_reduce`'s single-rank branch divides again after its pre-division): ep_size = shards gives
  expert gradients 1/world too small. Here the reduction sums and a hook divides once, in every case.
* accelerate's `fsdp_cpu_ram_efficient_loading` broadcasts rank 0's local expert shards as if they were
  the whole tensors; every rank built the same weights, so it is switched off under EP.

Data-parallel arithmetic: every rank still reads its own streams (EP ranks hold different batches); the
experts' all-to-all backward brings each expert the gradients of every token of its ep group, the expert
FSDP sums those over efsdp and the replica groups (every rank once), and the hook divides by the world
size, as FSDP2 averages the dense gradients: both are the mean over the ranks the loss normalisation
expects.
"""

from __future__ import annotations

import torch
from torch import nn

from lmpretrain.errors import LaunchError
from lmpretrain.layout import Layout
from lmpretrain.model.experts import expert_count

DISPATCH = "ep_dispatch_experts"  # transformers' EP style of a module whose forward exchanges the tokens


def ep_problems(cfg, model_config, layout: Layout) -> list[str]:
    """model.ep_size that cannot run: not sharded by FSDP2, a world or expert count it does not divide, a
    model without an expert-parallel plan, switches not tried with it."""
    ep = cfg.model.ep_size
    if ep == 1:
        return []
    p = []
    experts = expert_count(model_config)
    plan = getattr(model_config, "base_model_ep_plan", None) or {}
    if DISPATCH not in plan.values():
        p.append(
            f"model.ep_size={ep}: transformers' {model_config.model_type} config has no expert-parallel plan "
            f"(base_model_ep_plan with an {DISPATCH} rule); set model.ep_size=1"
        )
    elif experts is not None and experts % ep:
        p.append(f"model.ep_size={ep} must divide the model's {experts} experts per layer")
    if layout.kind != "fsdp2":
        p.append(
            f"model.ep_size={ep} runs under FSDP2 or HSDP (the experts are sharded over the ranks), but this "
            f"launch is {layout.describe().split()[0]}: launch with configs/accelerate/cpu-fsdp.yaml, fsdp.yaml "
            "or hsdp.yaml"
        )
    elif layout.shards % ep:  # an ep group lies inside one shard group (transformers' DistributedConfig)
        groups = f" ({layout.replicas} replica groups x {layout.shards} shards)" if layout.hsdp else ""
        p.append(f"model.ep_size={ep} must divide the {layout.shards} ranks of a shard group{groups}")
    for key, on in (("train.compile", cfg.train.compile), ("train.fp8", cfg.train.fp8 != "none")):
        if on:
            p.append(f"{key} has not been tried with model.ep_size > 1: turn one of them off")
    return p


def apply(model: nn.Module, layout: Layout, accelerator) -> list[str]:
    """Shard `model`'s experts over the layout's `experts` ranks (model.ep_size) before the optimizer is built
    and before `accelerator.prepare` (which then shards the rest with the launch's FSDP2 plugin); returns the
    start-up lines. Nothing at 1."""
    ep_size, replicas = layout.experts, layout.replicas
    if ep_size == 1:
        return []
    plugin = accelerator.state.fsdp_plugin
    plugin.cpu_ram_efficient_loading = False  # see the module's doc
    world = accelerator.num_processes
    layout, experts = shard_experts(
        model,
        ep_size,
        world,
        replicas,
        reshard_after_forward=plugin.reshard_after_forward,
        mp_policy=plugin.mixed_precision_policy,
    )
    total = experts[0].num_experts * ep_size
    return [
        f"expert parallelism: {len(experts)} MoE layers' {total} experts split over ep_size={ep_size} ranks "
        f"({total // ep_size} each), tokens exchanged by all-to-all (transformers' DistributedConfig "
        f"ep_implementation=all_to_all); each ep group's experts FSDP2-sharded over {layout.efsdp_size} rank(s)"
        + (f" x {replicas} replica groups" if replicas > 1 else "")
        + f"; expert gradients summed over the ranks and divided by {world}"
    ]


def shard_experts(
    model: nn.Module,
    ep_size: int,
    world: int,
    replicas: int = 1,
    reshard_after_forward=True,
    mp_policy=None,
    implementation: str = "all_to_all",
):
    """transformers' expert parallelism on `model`, then FSDP2 on each experts module over efsdp (and the
    replica groups); returns the DistributedConfig and the experts modules. Every rank calls it, after the
    process group is up. `implementation`: the EPImplementation by its registered name (the planner's
    balanced one, plan/balanced_routing.py; runs use transformers' all_to_all)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers.distributed import DistributedConfig
    from transformers.distributed.expert_parallel import apply_expert_parallelism
    from transformers.distributed.utils import initialize_distributed_mesh

    try:
        layout = DistributedConfig(
            fsdp_size=world // replicas,
            dp_replicate_size=replicas,
            ep_size=ep_size,
            ep_implementation="all_to_all",
        )
    except ValueError as err:  # transformers' own rule, e.g. ep_size must divide fsdp_size
        raise LaunchError(
            f"model.ep_size={ep_size} must divide the {world // replicas} ranks of a shard group ({replicas} "
            f"replica groups x {world // replicas} shards; transformers' DistributedConfig: {err})"
        ) from err
    _, meshes = initialize_distributed_mesh(layout)
    # transformers 5.24 resolves (and expands per layer) the model's plans only inside from_pretrained's
    # maybe_distribute_model, which also FSDP-shards everything; this is that step's expert part.
    _, plan, _ = model._resolve_parallel_plans(layout)
    apply_expert_parallelism(model, meshes.get_mesh("ep"), meshes.get_mesh("tp"), plan, implementation)
    expert_mesh = meshes.get_mesh(("dp_replicate", "efsdp") if replicas > 1 else "efsdp")
    experts = [model.get_submodule(name) for name, style in plan.items() if style == DISPATCH]
    for module in experts:
        fully_shard(
            module,
            mesh=expert_mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy or MixedPrecisionPolicy(),
        )
        # Sum over every rank holding these experts, then divide once (see the module's doc).
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
        module.set_all_reduce_hook(_divide_by(world))
    return layout, experts


def _divide_by(world: int):
    def divide(grad: torch.Tensor) -> None:
        grad.div_(world)

    return divide
