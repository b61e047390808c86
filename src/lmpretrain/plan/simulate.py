"""One optimizer step of a config as rank 0 of a world of any size, without the GPUs or the memory.

The model is built as the recipe builds it (model/build.py, the loss inside its forward, the speed
switches of model/speed.py), under torch's FakeTensorMode (tensors with shapes, dtypes and storages but no
data) and a fake process group of `world` ranks (collectives that move nothing, so one process is rank 0
of 1,024). It is wrapped as the launch says: FSDP2 by accelerate's own `fsdp2_prepare_model` (the same
units and MixedPrecisionPolicy the recipe gets); DDP and DeepSpeed ZeRO-1/2 run unwrapped, their buckets,
partitions and all-reduce added as arithmetic (`wrap_arithmetic`). Then every kind of micro-batch the step
has runs forward and backward (the first K-1 without gradient sync unless train.sync_each_micro_batch, the
last with it: the others repeat the first), then clipping and the optimizer step, under torch's MemTracker / FSDPMemTracker (memory by
category), FlopCounterMode and CollectiveBytes (collectives/bytes). With `fake=False` the same step runs on
real tensors, which is what the tests compare against.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import types
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModMemStats
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from lmpretrain.gpus import GPU
from lmpretrain.layout import Layout
from lmpretrain.model.build import build_model
from lmpretrain.model.objective import LMObjective, install_loss_forward, weighted_sum
from lmpretrain.model.speed import enable_activation_checkpointing, fuse_gelu_tanh
from lmpretrain.observe.collectives import KINDS, CollectiveBytes
from lmpretrain.update.optim import build_optimizer

PRECISIONS = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Step:
    """What one optimizer step costs rank 0: bytes, FLOPs (executed, recomputation included) and comm."""

    params: int  # bytes this rank holds of each kind, between steps
    grads: int
    optimizer: int
    activations_peak: int
    buffers: int  # at the peak: unsharded parameters/gradients, all-gather/reduce-scatter and DDP buckets, temporaries
    total_peak: int
    flops: dict[str, float]  # forward, backward, optimizer
    comm: dict[str, float]  # kind -> bytes received per step (muon: the optimizer step's)
    muon_comm: dict[str, float] = field(default_factory=dict)  # Muon's bytes by kind
    ema: int = (
        0  # train.ema_decay: the moving average, a float32 (float64) copy of this rank's trainable shards
    )
    unsharded_param_bytes: int = 0  # what the forward reads (the HBM estimate)
    micro_batch_peak: int = 0  # the peak during forward/backward, and of it what grows with the rows
    row_bytes: int = 0  # (activations and temporaries)
    step_peak: int = 0  # the peak during the optimizer step
    # parameter values per optimizer group (ZeRO's partitions)
    group_values: list[int] = field(default_factory=list)


class _FSDPTracker(FSDPMemTracker):
    """FSDPMemTracker for a unit whose forward never runs: the tied output embedding of the chunked loss,
    whose weight the loss reads directly (torch's tracker meets it first in backward and has no record)."""

    def _fsdp_param_group_pre_backward(self, fsdp_mod, orig):
        inner = super()._fsdp_param_group_pre_backward(fsdp_mod, orig)

        def seeded(*args, **kwargs):
            if fsdp_mod not in self.memory_tracking:
                self.memory_tracking[fsdp_mod] = _FSDPModMemStats(type(fsdp_mod).__name__)
            return inner(*args, **kwargs)

        return seeded


def _cpu_flash(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _grouped_mm(a, b, *args, out_shape=None, **kwargs) -> int:
    """torch's grouped matmul (a mixture of experts' grouped_mm): every row of one operand meets exactly one
    group's matrix of the other, so its multiply-adds are those of the ungrouped product of the whole operands:
    2D x 3D [M, K] x [G, K, N] (forward) is 2MKN, 2D x 2D grouped along K (the weights' gradient) 2MKN,
    3D x 3D a batch, 3D x 2D grouped along N."""
    if len(a) == 2 and len(b) == 3:  # the counter passes shapes
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    return 2 * a[-2] * a[-1] * b[-1]


# sdpa on the CPU runs its own FlashAttention kernel, which torch's FLOP counter has no formula for; it is the
# CUDA flash kernel's arithmetic (the same formulas torch uses for that one). Likewise the grouped matmul.
_FLOP_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
    torch.ops.aten._grouped_mm: _grouped_mm,  # torch's counter has no formula for it
}


class _NoModules:
    """A ModuleTracker stand-in that tracks nothing: every FLOP is the global total's ("Global")."""

    parents = frozenset({"Global"})

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None


def _flop_counter() -> FlopCounterMode:
    """torch's FLOP counter without its per-module breakdown (only the total is read). Its ModuleTracker keeps a
    gradient hook on each module's inputs and outputs until it exits; in backward, under activation
    checkpointing, those are each block's *recomputed* tensors, so every block's recomputed graph and its
    activations stayed alive to the end of backward, as no real step keeps them (a Llama of 8 blocks with
    checkpointing: 112 MB at the peak under the counter, 41 MB without it; 134 MB without checkpointing)."""
    counter = FlopCounterMode(display=False, custom_mapping=_FLOP_FORMULAS)
    counter.mod_tracker = _NoModules()
    return counter


class LiveBytes(TorchDispatchMode):
    """The most bytes of tensors created inside it that were alive at once (`peak`), and those still alive."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._storages: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self._storages.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t == DTensor for t in types):  # count the local tensors DTensor's ops create
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):  # in place or a view: nothing new
            return out
        if _in_sharding_propagation():
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self._storages:
                    self._storages[key] = storage.nbytes()
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.live)
        return out


def _in_sharding_propagation() -> bool:
    """Inside DTensor's sharding propagation, which runs each new op once on fake tensors of the *global*
    shapes (whole parameters) to learn its output's shape: metadata that holds no memory on any device
    (torch/distributed/tensor/_sharding_prop.py), but tensors this mode would otherwise count."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _PROPAGATE_META:
            return True
        frame = frame.f_back
    return False


_PROPAGATE_META = ShardingPropagator._propagate_tensor_meta_non_cached.__code__


def _nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


@contextlib.contextmanager
def fake_process_group(world: int):
    """This process as rank 0 of `world` ranks of torch's fake backend, unless a group of that size exists.
    The group made here is destroyed on exit: left behind, it made everything that ran next in the process
    (a test computing a one-process reference) see `world` ranks whose collectives move nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_world_size() == world:  # real processes (the tests' gloo), or the caller's fake group
            yield
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fsdp2(model, cfg, launch: Layout, world: int):
    """Shard as the recipe's accelerate does: its fsdp2_prepare_model with the recipe's plugin settings."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.device_mesh import init_device_mesh

    from lmpretrain.model.sharded_precision import fsdp_policy

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=launch.reshard_after_forward,
        auto_wrap_policy="transformer_based_wrap",
        mixed_precision_policy=fsdp_policy(cfg.train),
        cpu_ram_efficient_loading=False,  # loading is not part of a step
    )
    # accelerate's mesh: 1-D over every rank, or HSDP's (replica groups, shards), sharded over the last dim
    shape, names = ((world,), ("dp_shard",)) if launch.replicas == 1 else (
        (launch.replicas, launch.shards), ("dp_replicate", "dp_shard")
    )  # fmt: skip
    with torch._subclasses.fake_tensor.unset_fake_temporarily():  # the mesh holds real rank numbers
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    stand_in = types.SimpleNamespace(  # the attributes fsdp2_prepare_model reads from an Accelerator
        state=types.SimpleNamespace(fsdp_plugin=plugin),
        torch_device_mesh=mesh,
        parallelism_config=types.SimpleNamespace(fsdp_dim_names=list(names)),
        mixed_precision="no",  # the recipe's: it owns precision (model/sharded_precision.py)
        is_main_process=True,
        device=torch.device("cpu"),
    )
    return fsdp2_prepare_model(stand_in, model)


def _shard_experts(model, cfg, launch: Layout) -> None:
    """The experts over the ep group and FSDP2 over efsdp, before the optimizer and accelerate's FSDP2, as in the
    recipe; the tokens exchanged as a balanced router would send them (plan/balanced_routing.py)."""
    from lmpretrain.model.sharded_precision import fsdp_policy
    from lmpretrain.plan import balanced_routing
    from lmpretrain.run.expert_parallel import shard_experts

    # Outside the fake mode: FSDP2 on a parameter already sharded by EP concatenates device meshes, which
    # index a real tensor of ranks; the parameters are fake tensors and stay so (each op on them runs in
    # their own fake mode).
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        shard_experts(
            model,
            launch.experts,
            launch.num_processes,
            launch.replicas,
            reshard_after_forward=launch.reshard_after_forward,
            mp_policy=fsdp_policy(cfg.train),
            implementation=balanced_routing.NAME,
        )


@contextlib.contextmanager
def _gradient_sync(model, launch: Layout, sync: bool):
    """accelerate.accumulate's no-sync for the micro-batches before the last (FSDP2: unsharded grads kept)."""
    if launch.kind == "fsdp2":
        model.set_requires_gradient_sync(sync)
    yield


def simulate(
    cfg, model_config, launch: Layout, micro_batch: int, *, fake: bool = True, gpu: GPU | None = None
) -> Step:
    """One step of `cfg` at `micro_batch` rows per micro-batch, as rank 0 of launch.num_processes; `gpu`: the
    target, whose roofline decides Muon's spread (optim.muon_spread=auto) as on it (None: this CPU's, as a
    CPU run decides)."""
    with fake_process_group(launch.num_processes):
        return _simulate(cfg, model_config, launch, micro_batch, fake=fake, gpu=gpu)


def _simulate(cfg, model_config, launch: Layout, micro_batch: int, *, fake: bool, gpu: GPU | None) -> Step:
    world = launch.num_processes
    # Garbage of earlier work in this process, freed by the collector during the tracked step, would be
    # booked by the real-mode tracker (default.yaml with checkpointing: 106-119 MB of activations and
    # temporaries by what ran before; 115 MB after a collection, every time).
    gc.collect()
    mode = torch._subclasses.fake_tensor.FakeTensorMode() if fake else contextlib.nullcontext()
    deepspeed = launch.kind == "deepspeed"
    dtype = PRECISIONS[cfg.train.precision]
    with mode:
        model = build_model(model_config, None, cfg.train.param_dtype)
        install_loss_forward(model)
        fuse_gelu_tanh(model)
        enable_activation_checkpointing(model, cfg.train.activation_checkpointing)
        if launch.experts > 1:  # expert parallelism, as the recipe applies it (run/expert_parallel.py)
            _shard_experts(model, cfg, launch)
        if deepspeed and dtype is not None:  # the engine trains 16-bit weights (fp32 masters: arithmetic)
            model.to(dtype)
        # Built before wrapping, as in the recipe (Muon finds the blocks by their class names, which FSDP2
        # changes); then pointed at the sharded parameters, as accelerate's prepare does.
        optimizer = build_optimizer(model, cfg.optim, torch.device("cpu"), launch, gpu)
        if launch.kind == "fsdp2":
            names = {id(p): n for n, p in model.named_parameters()}
            groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
            model = _fsdp2(model, cfg, launch, world)
            sharded = dict(model.named_parameters())
            for group, group_names in zip(optimizer.param_groups, groups, strict=True):
                group["params"][:] = [sharded[n] for n in group_names]
        # No tokenizer here: the model config's EOS id, or any id for a fork's config without one (which id ends
        # a document changes no shape).
        objective = LMObjective.from_config(cfg, getattr(model_config, "eos_token_id", None) or 0)
        ids = torch.randint(0, model_config.vocab_size, (micro_batch, cfg.data.seq_len))
        if launch.kind == "fsdp2":
            tracker = _FSDPTracker(model, optimizer)
            tracker.track_inputs((ids,))
        else:
            tracker = MemTracker()
            tracker.track_external(model, optimizer, ids)
        accum = cfg.train.grad_accum_steps
        # (sync?, repeats): the first accum - 1 micro-batches repeat the first; they reduce-scatter their
        # gradients too with train.sync_each_micro_batch (FSDP2), else they keep them unsharded
        kinds = [(cfg.train.sync_each_micro_batch, accum - 1), (True, 1)] if accum > 1 else [(True, 1)]
        flops = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        comm = {kind: 0.0 for kind in KINDS}
        muon_comm: dict[str, float] = {}
        autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype is not None and not deepspeed)
        grads = 0

        def micro_batch(sync: bool) -> tuple[dict, float, float]:
            """One micro-batch's forward and backward: its collectives' bytes, forward and backward FLOPs."""
            with _gradient_sync(model, launch, sync), CollectiveBytes() as counted:
                with _flop_counter() as forward, autocast:
                    terms = objective(model, ids, ids)
                with _flop_counter() as backward:
                    weighted_sum(terms).backward()
            return dict(counted.received), forward.get_total_flops(), backward.get_total_flops()

        # torch's FSDPMemTracker gathers and reduces more than training does (its hooks re-run FSDP2's: a
        # smoke-shaped step counted 2.5x the all-gather bytes of a real recipe run under it), so under FSDP2
        # the micro-batches' collectives are counted on an untracked pass of the same micro-batches first.
        untracked = None
        if launch.kind == "fsdp2":
            untracked = [micro_batch(sync)[0] for sync, _ in kinds]
            model.zero_grad(set_to_none=True)
        tracked = []
        with tracker:
            for sync, _ in kinds:
                if not isinstance(tracker, FSDPMemTracker):  # its module stats are per call; the peak stays
                    tracker.reset_mod_stats()
                tracked.append(micro_batch(sync))
        received = untracked or [bytes_ for bytes_, _, _ in tracked]
        for (_, repeats), (_, forward, backward), counts in zip(kinds, tracked, received, strict=True):
            flops["forward"] += repeats * forward
            flops["backward"] += repeats * backward
            for kind, value in counts.items():
                comm[kind] += repeats * value
        with CollectiveBytes() as counted:
            if cfg.train.max_grad_norm > 0:
                # what the recipe's accelerator.clip_grad_norm_ runs: a norm per device mesh (expert
                # parallelism's experts have their own), combined; torch's clip_grad_norm_ with one mesh
                Accelerator._clip_grad_norm_dtensor_aware(
                    None, list(model.parameters()), cfg.train.max_grad_norm
                )
        for kind, value in counted.received.items():
            comm[kind] += value
        grads = sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None)
        # The step is measured apart (LiveBytes): under FakeTensorMode torch's FSDPMemTracker books far more
        # optimizer state during the step than the step keeps (3x on an FSDP2 Llama, not so on real tensors).
        with CollectiveBytes() as counted, _flop_counter() as step, LiveBytes() as step_memory:
            optimizer.step()
        flops["optimizer"] = step.get_total_flops()
        muon_comm = dict(counted.received)
        if cfg.optim.name not in (
            "muon",
            "normuon",
        ):  # AdamW's step: no collectives of its own (none under FSDP2)
            for kind, value in muon_comm.items():
                comm[kind] += value
            muon_comm = {}
        optimizer.zero_grad(set_to_none=True)
        comm["muon"] = sum(muon_comm.values())
        params = sum(_nbytes(p) for p in {id(p): p for p in model.parameters()}.values())
        opt_state = sum(
            _nbytes(t) for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)
        )
        unique = {id(p): p for p in model.parameters()}.values()
        # update/ema.py: the average is held like the weights (their shards) in float32, float64 for float64 ones
        ema = sum(
            _nbytes(p) // p.element_size() * (8 if p.dtype == torch.float64 else 4) for p in unique if p.requires_grad
        ) if cfg.train.ema_decay is not None else 0  # fmt: skip
        # what each forward/backward reads: every parameter whole (DTensor.numel is the global one), in compute dtype
        unsharded = sum(p.numel() * (dtype.itemsize if dtype else p.element_size()) for p in unique)
    peak = max(tracker.get_tracker_snapshot("peak").values(), key=lambda s: s["Total"])
    activations = peak.get("Activation", 0) + peak.get("Inputs", 0)
    # From the second step on the optimizer state is there during every forward and backward too.
    micro_batches = peak["Total"] - peak.get("OptState", peak.get("Optstate", 0)) + opt_state + ema
    # the step's new bytes (its first state, temporaries, whole matrices) over what it holds
    in_step = params + grads + ema + step_memory.peak
    total = max(micro_batches, in_step)
    transient = ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter", "Temp", "Buffer")
    buffers = (
        sum(peak.get(name, 0) for name in transient)
        if micro_batches >= in_step
        else in_step - params - grads - opt_state - ema
    )
    step_bytes = Step(
        params=params,
        grads=grads,
        optimizer=opt_state,
        ema=ema,
        activations_peak=activations,
        buffers=buffers,
        total_peak=total,
        flops=flops,
        comm=comm,
        muon_comm=muon_comm,
        unsharded_param_bytes=unsharded,
        micro_batch_peak=micro_batches,
        row_bytes=activations + peak.get("Temp", 0),
        step_peak=in_step,
        group_values=[sum(p.numel() for p in g["params"]) for g in optimizer.param_groups if g["params"]],
    )
    return wrap_arithmetic(step_bytes, launch, cfg)


def wrap_arithmetic(step: Step, launch: Layout, cfg) -> Step:
    """DDP and DeepSpeed ZeRO-1/2, which the simulation runs unwrapped, as arithmetic on its bytes.

    DDP (torch's defaults, as accelerate passes them: gradient_as_bucket_view=False): gradient buckets as large
    as the gradients, all-reduced once per step. DeepSpeed ZeRO, as its engine does it (checked against it on
    2 gloo ranks: tests/test_deepspeed.py): each optimizer group's parameters are flattened, padded to a
    multiple of 2 x W values and split in W partitions; each rank keeps the fp32 master weights and fp32
    AdamW moments of its partitions (and a step counter per group), whatever the model's dtype, and stage 2
    the fp32 gradients of its partitions for the step (stage 1: the whole gradients, as without ZeRO). The
    gradients are all-reduced in the model's dtype (DeepSpeed's buckets, 5e8 values, span ranks: its
    multi-rank bucket all-reduce) and the updated weights all-gathered.
    """
    world = launch.num_processes
    if launch.kind == "ddp":
        step.buffers += step.grads
        step.total_peak += step.grads
        step.comm["all_reduce"] += 2 * step.grads * (world - 1) / world
    elif launch.kind == "deepspeed":
        fp32 = 4
        parts = [-(-n // (2 * world)) * 2 for n in step.group_values]  # values per rank, per group
        optimizer = sum(3 * fp32 * n + fp32 for n in parts)  # masters, 2 moments; the step counter
        grads = sum(fp32 * n for n in parts) if launch.zero_stage == 2 else step.grads
        step.total_peak += optimizer - step.optimizer + grads - step.grads
        step.comm["all_reduce"] += 2 * step.grads * (world - 1) / world
        step.comm["all_gather"] += step.params * (world - 1) / world
        step.optimizer, step.grads = optimizer, grads
    return step
