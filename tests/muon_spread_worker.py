"""One rank of tests/test_muon_spread.py's gloo runs: tiny float64 models take two Muon steps on the same
batch on every rank, sharded by FSDP2 (fully_shard; at 4 ranks also HSDP, a 2 x 2 mesh of replicas and
shards) or replicated as under DDP (same gradients on every rank), with optim.muon_spread always and
never; and two NorMuon steps (with Polar Express coefficients) spread under each. Rank 0 saves each run's
final weights and, per rank and step, the bytes the optimizer step's collectives received and the
Newton-Schulz FLOPs it ran.

    python tests/muon_spread_worker.py OUT_FILE  (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from muon_spread_models import MODELS, OPTIMIZERS, batch, build, cases, muon_cfg  # noqa: E402

from lmpretrain.update import muon_spread  # noqa: E402
from lmpretrain.update.muon_spread import ns_flops  # noqa: E402
from lmpretrain.update.optim import build_optimizer  # noqa: E402


class Received:
    """Bytes this rank receives from other ranks in the plain torch.distributed collectives Muon calls
    (a wrapper around each, restored on exit); NorMuon's all-reduces of a few sums per matrix are counted
    as calls only."""

    def __init__(self):
        self.bytes, self.calls, self._saved = 0, {}, {}

    def __enter__(self):
        for name in (
            "all_to_all_single",
            "all_gather_into_tensor",
            "broadcast",
            "all_gather",
            "scatter",
            "gather",
            "all_reduce",
        ):
            self._saved[name] = original = getattr(dist, name)
            setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)

    def _wrap(self, name, original):
        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            if name == "all_to_all_single":  # (output, input, output_split_sizes, ...): all but our own split
                out, splits = args[0], args[2]
                self.bytes += (out.numel() - splits[dist.get_rank(kwargs.get("group"))]) * out.element_size()
            elif name == "all_gather_into_tensor":  # (output, input): all but our own part
                self.bytes += (args[0].numel() - args[1].numel()) * args[0].element_size()
            return original(*args, **kwargs)

        return counted


class Work:
    """Newton-Schulz FLOPs this rank runs (the batched iteration's inputs, counted as muon_spread sees them)."""

    def __init__(self):
        self.flops = 0

    def __enter__(self):
        self._saved = original = muon_spread.orthogonalise_all

        def counted(mats, steps, *args, **kwargs):
            self.flops += sum(ns_flops(tuple(m.shape), steps) for m in mats)
            return original(mats, steps, *args, **kwargs)

        muon_spread.orthogonalise_all = counted
        return self

    def __exit__(self, *exc):
        muon_spread.orthogonalise_all = self._saved


def main() -> None:
    out_file = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    meshes = {"fsdp2": init_device_mesh("cpu", (world,))}
    if world == 4:
        meshes["hsdp"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    results = {}
    for model_type in MODELS:
        for layout, spread, name in cases(world):
            model = build(model_type)
            opt = build_optimizer(model, muon_cfg(muon_spread=spread, **OPTIMIZERS[name]))  # as the recipe
            if layout in meshes:
                mesh = meshes[layout]
                names = {id(p): n for n, p in model.named_parameters()}
                for block in model.model.layers if hasattr(model, "model") else model.transformer.h:
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
                sharded = dict(model.named_parameters())  # fully_shard made new (DTensor) parameters
                for group in opt.param_groups:
                    group["params"] = [sharded[names[id(p)]] for p in group["params"]]
            muon_bytes = sum(
                p.numel() * p.element_size()
                for g in opt.param_groups
                if g["kind"] == "muon"
                for p in g["params"]
            )
            received, funcol, work = [], [], []
            for step in range(2):
                ids = batch(step)
                model(input_ids=ids, labels=ids).loss.backward()
                with Received() as counter, CommDebugMode() as comm, Work() as flops:
                    opt.step()
                opt.zero_grad(set_to_none=True)
                received.append(counter.bytes)
                work.append(flops.flops)
                funcol.append({str(k): v for k, v in comm.get_comm_counts().items()})
            weights = {
                n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in model.named_parameters()
            }
            stats = torch.tensor([float(b) for b in received + work], dtype=torch.float64)
            everyone = [torch.zeros_like(stats) for _ in range(world)]
            dist.all_gather(everyone, stats)
            results[(model_type, layout, spread, name)] = {
                "weights": weights,
                "received": [t[:2].tolist() for t in everyone],  # [rank][step]
                "flops": [t[2:].tolist() for t in everyone],  # [rank][step]
                "muon_bytes": muon_bytes,
                "largest": max(
                    p.numel() * p.element_size()
                    for g in opt.param_groups
                    if g["kind"] == "muon"
                    for p in g["params"]
                ),
                "funcol": funcol,
                "calls": counter.calls,
            }
    if rank == 0:
        torch.save(results, out_file)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    main()
