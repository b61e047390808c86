"""One rank of tests/test_expert_parallel.py's gloo runs: the tiny float64 Qwen3-MoE (moe_ep_models.py)
with its experts split over ep_size=2 ranks by lmpretrain.run.expert_parallel.shard_experts, the rest
FSDP2-sharded per layer and at the root as accelerate does (HSDP at 4 ranks too), two Muon steps on this
rank's rows of a global batch. Rank 0 saves each case's whole weights, its first step's whole gradients
and how many experts of each stack it holds.

    python tests/moe_ep_worker.py OUT_FILE  (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_ep_models import batch, build, cases, muon_cfg  # noqa: E402

from lmpretrain.run.expert_parallel import shard_experts  # noqa: E402
from lmpretrain.update.optim import build_optimizer  # noqa: E402


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def main() -> None:
    out_file = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for routing, experts_impl, layout in cases(world):
        replicas = 2 if layout == "hsdp" else 1
        model = build(routing, experts_impl)
        shard_experts(model, 2, world, replicas)
        opt = build_optimizer(model, muon_cfg())  # as the recipe: before the rest is sharded
        names = {id(p): n for n, p in model.named_parameters()}
        mesh = (
            init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            if layout == "hsdp"
            else init_device_mesh("cpu", (world,))
        )
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sharded = dict(model.named_parameters())  # fully_shard made new (DTensor) parameters
        for group in opt.param_groups:
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        for step in range(2):
            rows = batch(step).chunk(world)[rank]
            model(input_ids=rows, labels=rows).loss.backward()
            if step == 0:  # Muon and AdamW hide a gradient's scale: compare the gradients themselves
                grads = {n: whole(p.grad).clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad(set_to_none=True)
        weights = {n: whole(p).detach().clone() for n, p in model.named_parameters()}
        local = {n: p.to_local().shape[0] for n, p in model.named_parameters() if p.dim() == 3}
        results[(routing, experts_impl, layout)] = {
            "weights": weights,
            "grads": grads,
            "local_experts": local,
        }
    if rank == 0:
        torch.save(results, out_file)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    main()
