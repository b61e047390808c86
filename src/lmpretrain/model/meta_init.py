"""Meta-device init: under FSDP2/HSDP every rank builds the model on the meta device and, once it is sharded,
fills only its own shards, with the values a host build from the same seed would hold, bit for bit.

A host build (`from_config` on the CPU) costs every rank the whole fp32 model in host memory and the CPU time
to initialise it. Here the build runs on the meta device (no memory) under a TorchDispatchMode that records
every in-place op on a meta tensor: the constructors' default inits (nn.Linear's kaiming uniform, ...), every
nested `init_weights` that transformers' `post_init` calls (run at the same points as on the host, with the
CPU as the device inside so that tensors they compute, such as RoPE's inverse frequencies, are real), μP's
rescaling and the objective's modules. After accelerate's own FSDP2 wrapping (`fsdp2_prepare_model`) and
`to_empty`, the ops are replayed in order from the seed's generator state:

* a random op (`normal_`, `uniform_`) draws the whole tensor's numbers in chunks and keeps the part that lands
  in this rank's shard, so the generator advances exactly as on the host (a rank holds one chunk, never the
  whole tensor). torch's CPU `uniform_` draws one number per element in order; its `normal_` fills uniforms in
  order and transforms them 16 at a time, recomputing the last 16 of a tensor whose size 16 does not divide,
  so chunks of a multiple of 16 elements, the last of 16 + the remainder, draw what the whole tensor draws
  (the equality is tested against `from_config`, on whichever CPU runs the tests);
* an elementwise op (`fill_`, `zero_`, `copy_`, `mul_`, ... on a tensor or a view of it) runs on the
  elements this rank holds.

A build this cannot replay (a random op other than those two or on a view, a tensor whose value only a factory
call set, a copy from a meta tensor) is built on the host as before, and the start-up line says why. So is a
pretrained model (accelerate's rank-0 loading), expert parallelism and FP8 (they rewrite the modules before
sharding), and one process (it holds the whole model anyway).

Under DDP and DeepSpeed ZeRO-1/2 every rank trains the whole model, whose initial weights their wrapping
broadcasts from rank 0 (DDP's parameters and buffers, DeepSpeed's engine its parameters). So rank 0 alone builds
it on the host; the others build it on meta, give it uninitialised memory on their device (no host copy, no CPU
init), take rank 0's buffers and generator state here and its parameters from the wrapping.
"""

from __future__ import annotations

import contextlib
import copy
import math
import resource
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import PreTrainedModel

from lmpretrain.errors import UserError

aten = torch.ops.aten
RANDOM = (aten.normal_.default, aten.uniform_.default)
SETS = (aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default, aten.copy_.default)  # define every element
CHUNK = 1 << 22  # elements a rank draws at a time (16 MB of fp32); a multiple of 16, as normal_ needs
# An op on a view of a tensor (an embedding's padding row) is replayed through the view's element indices
# (8 bytes each), up to this many.
SMALL_VIEW = 1 << 20


class _Op:
    """One recorded in-place op on a meta tensor: which tensor, its dtype and geometry then, and the call."""

    def __init__(self, func, args, kwargs):
        target = args[0]
        self.func, self.rest, self.kwargs = func, args[1:], kwargs
        self.base = target._base if target._base is not None else target
        self.dtype, self.numel = target.dtype, target.numel()
        self.whole = (
            target.shape == self.base.shape and target.storage_offset() == 0 and target.is_contiguous()
        )
        self.view = None if self.whole else (tuple(target.shape), target.stride(), target.storage_offset())

    def problem(self, name: str, defined: bool) -> str | None:
        """Why this op cannot be replayed on `name`'s shards, if it cannot."""
        if not self.base.is_contiguous():
            return f"{name} is not contiguous"
        if self.func in RANDOM:
            if self.kwargs.get("generator") is not None:
                return f"{name} is drawn from a generator of its own"
            return None if self.whole else f"{name} is drawn on a view ({self.func})"
        if self.func not in SETS and torch.Tag.pointwise not in self.func.tags:
            return f"{name} is set by {self.func}, not an elementwise op"
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in self.rest):
            return f"{name} is computed from another meta tensor ({self.func})"
        if not self.whole and self.numel > SMALL_VIEW:
            return f"{name} is set through a view of {self.numel:,} elements"
        if not defined and (self.func not in SETS or not self.whole):
            return f"{name} is changed by {self.func} before any op set all of it"
        return None


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[_Op] = []
        self.problems: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        meta = args and isinstance(args[0], torch.Tensor) and args[0].is_meta
        if meta and torch.Tag.inplace in func.tags:
            self.ops.append(_Op(func, args, kwargs))
        elif torch.Tag.nondeterministic_seeded in func.tags and _any_meta(out):
            self.problems.append(f"a tensor is drawn by {func} when it is made")
        return out


def _any_meta(out) -> bool:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in outs)


@contextlib.contextmanager
def _nested_inits_on_the_host():
    """transformers skips `init_weights` under a meta device context; run it (on the meta tensors, recorded)
    with the CPU as the device inside, at the same points a host build runs it."""
    original = PreTrainedModel.init_weights

    def init_weights(self):
        with torch.device("cpu"):
            original(self)

    PreTrainedModel.init_weights = init_weights
    try:
        yield
    finally:
        PreTrainedModel.init_weights = original


def _tensors(model: nn.Module) -> dict[int, str]:
    """id of each parameter and buffer -> its (first) name."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    names: dict[int, str] = {}
    for name, t in named:
        names.setdefault(id(t), name)
    return names


def to_empty_tied(model: nn.Module, device) -> None:
    """`model.to_empty(device)`, keeping tied parameters one: from meta, `to_empty` gives each module a
    parameter of its own (a tied lm_head would train apart from the embedding)."""
    names = [(name, id(p)) for name, p in model.named_parameters(remove_duplicate=False)]
    model.to_empty(device=device)
    first: dict[int, nn.Parameter] = {}
    for name, key in names:
        if key not in first:
            first[key] = model.get_parameter(name)
        else:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first[key])


def _group_names(optimizer, names: dict[int, str]) -> list[list[str]]:
    """The names of each optimizer group's parameters (`names`: `_tensors` of the model), to find them again
    once the model's parameters are replaced (sharded, or given memory)."""
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def _point_at(optimizer, groups: list[list[str]], by_name: dict[str, torch.Tensor]) -> None:
    """Each optimizer group at the model's new parameters of the names `_group_names` kept."""
    for group, group_names in zip(optimizer.param_groups, groups, strict=True):
        group["params"] = [by_name[n] for n in group_names]


def zeroed_host_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` on the CPU with every parameter zero, for a probe of what the module computes: the
    model's own may be on the meta device, and a probe must not change its weights."""
    copy_ = copy.deepcopy(module).to_empty(device="cpu")
    with torch.no_grad():
        for p in copy_.parameters():
            p.zero_()
    return copy_


def host_peak_rss_gb() -> float:
    """This process's peak resident host memory so far, GB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


class ModelInit:
    """How this run's model gets its initial weights: built on meta and replayed shard by shard (`meta`), or
    built on the host as `from_config` does (`host`, with the reason)."""

    def __init__(self, why_host: str | None, replicated: bool = False, rank: int = 0):
        self.why_host = why_host
        # DDP/DeepSpeed: the wrapping broadcasts rank 0's weights, which every other rank builds on meta
        self.replicated = replicated
        self.from_rank_zero = replicated and rank != 0
        self.ops: list[_Op] = []
        self.rng_state: torch.Tensor | None = None  # the generator at the build's start
        self.seconds = 0.0

    @classmethod
    def for_run(cls, cfg, layout, rank: int = 0) -> ModelInit:
        """`rank`: this process's (accelerator.process_index)."""
        if cfg.model.pretrained:
            why = f"model.pretrained: accelerate's {'FSDP2 ' if layout.kind == 'fsdp2' else ''}loading"
        elif cfg.model.ep_size > 1:
            why = f"model.ep_size={cfg.model.ep_size} rewrites the experts before sharding"
        elif cfg.train.fp8 != "none":
            why = f"train.fp8={cfg.train.fp8} rewrites the linear layers before sharding"
        elif layout.kind == "none":
            why = "one process"
        elif layout.kind != "fsdp2":  # DDP, DeepSpeed: their wrapping broadcasts rank 0's weights
            why = f"{layout.kind}: rank 0 builds it, its wrapping broadcasts it" if rank == 0 else None
            return cls(why, replicated=True, rank=rank)
        else:
            why = None
        return cls(why)

    @property
    def on_meta(self) -> bool:
        return self.why_host is None

    def build(self, make: Callable[[], tuple[nn.Module, list[str]]]) -> tuple[nn.Module, list[str]]:
        """`make()` (the model and its start-up lines) on meta, recorded; on the host when this run or the
        recording says so (then `make` runs again, from the same generator state)."""
        start = time.perf_counter()
        if self.from_rank_zero:
            return self._build_for_rank_zeros_weights(make, start)
        if self.on_meta:
            self.rng_state = torch.get_rng_state()
            recorder = _Recorder()
            try:
                with _nested_inits_on_the_host(), torch.device("meta"), recorder:
                    model, lines = make()
                problems = recorder.problems + self._replay_problems(model, recorder.ops)
                if not torch.equal(torch.get_rng_state(), self.rng_state):
                    problems.append("random numbers were drawn on the host during the build")
                why = f"its init cannot be replayed on shards: {problems[0]}" if problems else None
            # the config's problem, found on meta as on the host: no host build to find it again
            except UserError:
                raise
            except Exception as err:  # noqa: BLE001 - the host build below raises it again if it is the config's
                why = f"its build does not run on the meta device ({type(err).__name__}: {err})"
            if why is None:
                self.ops = recorder.ops
                self.seconds = time.perf_counter() - start
                return model, lines
            self.why_host = why
            torch.set_rng_state(self.rng_state)
        built = make()
        self.seconds = time.perf_counter() - start
        return built

    def _build_for_rank_zeros_weights(self, make, start: float):
        """A rank other than 0 under DDP/DeepSpeed: its build on meta (the host build where it does not run
        there); rank 0's generator state, which rank 0's host build left, is taken in `_take_rank_zeros`."""
        try:
            with torch.device("meta"):
                built = make()
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - the host build below raises it again if it is the config's
            self.why_host = f"its build does not run on the meta device ({type(err).__name__}: {err})"
            self.from_rank_zero = False
            built = make()
        self.seconds = time.perf_counter() - start
        return built

    @staticmethod
    def _replay_problems(model: nn.Module, ops: list[_Op]) -> list[str]:
        names = _tensors(model)
        defined: set[int] = set()
        problems = []
        for op in ops:
            name = names.get(id(op.base))
            if name is None:  # a tensor the model no longer holds: only its draws matter
                continue
            problem = op.problem(name, id(op.base) in defined)
            if problem:
                problems.append(problem)
            elif op.whole and (op.func in RANDOM or op.func in SETS):
                defined.add(id(op.base))
        problems += [
            f"{name} is set only by the call that made it" for i, name in names.items() if i not in defined
        ]
        return problems

    def materialise(self, model: nn.Module, optimizer, accelerator) -> list[str]:
        """Before `accelerator.prepare`: shard the meta model with accelerate's own FSDP2 wrapping, give each
        rank's shards memory and replay the init into them; the optimizer is pointed at the sharded parameters
        (accelerate maps them by name from there). A host-built model is left to accelerate; returns the
        start-up line."""
        if self.replicated:
            return self._take_rank_zeros(model, optimizer, accelerator)
        if not self.on_meta:
            return [f"model init: on the host ({self.why_host}), {self.seconds:.1f} s"]
        if not torch.equal(torch.get_rng_state(), self.rng_state):
            raise RuntimeError("random numbers were drawn between the model's meta build and its init")
        from accelerate.utils import fsdp2_prepare_model

        start = time.perf_counter()
        names = _tensors(model)
        groups = _group_names(optimizer, names)
        plugin = accelerator.state.fsdp_plugin
        plugin.cpu_ram_efficient_loading = False  # nothing to broadcast: every rank fills its own shards
        model = fsdp2_prepare_model(accelerator, model)
        to_empty_tied(model, accelerator.device)
        by_name = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
        held = self._replay({name: by_name[name] for name in set(names.values())}, names)
        _point_at(optimizer, groups, by_name)
        total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        return [
            f"model init: on meta, this rank filled its own shards ({held:,} of {total:,} parameters) in "
            f"{self.seconds + time.perf_counter() - start:.1f} s; host peak RSS {host_peak_rss_gb():.2f} GB"
        ]

    @torch.no_grad()
    def _take_rank_zeros(self, model: nn.Module, optimizer, accelerator) -> list[str]:
        """DDP/DeepSpeed, on every rank: a meta-built model gets memory on this rank's device (the optimizer
        pointed at it), every rank takes rank 0's buffers (DeepSpeed's engine broadcasts parameters only) and
        generator state (rank 0's build drew from it; what runs next must draw the same on every rank)."""
        import torch.distributed as dist

        if any(p.is_meta for p in model.parameters()):
            groups = _group_names(optimizer, _tensors(model))
            to_empty_tied(model, accelerator.device)
            _point_at(optimizer, groups, dict(model.named_parameters(remove_duplicate=False)))
        for _, buffer in sorted(model.named_buffers(), key=lambda named: named[0]):  # one order on every rank
            sent = buffer.to(accelerator.device)
            dist.broadcast(sent, src=0)
            if self.from_rank_zero:
                buffer.copy_(sent)
        state = [torch.get_rng_state()]
        dist.broadcast_object_list(state, src=0)
        torch.set_rng_state(state[0])
        if self.from_rank_zero:
            return [
                f"model init: on meta, rank 0's weights taken when wrapped; built in {self.seconds:.1f} s, host peak "
                f"RSS {host_peak_rss_gb():.2f} GB"
            ]
        return [
            f"model init: on the host ({self.why_host}; the other ranks build on meta), {self.seconds:.1f} s; "
            f"host peak RSS {host_peak_rss_gb():.2f} GB"
        ]

    @torch.no_grad()
    def _replay(self, tensors: dict[str, torch.Tensor], names: dict[int, str]) -> int:
        """Every recorded op in order, from the build's generator state; returns the parameter elements held."""
        torch.set_rng_state(self.rng_state)
        for op in self.ops:
            name = names.get(id(op.base))
            local, start = _local(tensors[name]) if name is not None else (None, 0)
            if op.func in RANDOM:
                _draw(op, local, start)
            elif local is not None:
                _apply(op, local, start)
        self.ops = []  # the meta tensors they hold go with them
        params = {n: t for n, t in tensors.items() if isinstance(t, nn.Parameter)}
        return sum(_local(t)[0].numel() for t in {id(t): t for t in params.values()}.values())


def _local(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The elements this rank holds of `t` (flat) and the flat index of the first in the whole tensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(t, DTensor):
        return t.view(-1), 0
    local = t.to_local()
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    row = math.prod(t.shape[1:])  # from the shape: indexing a DTensor would be a collective
    return local.view(-1), offset[0] * row if offset else 0


def _chunks(numel: int):
    """Flat [a, b) pieces of a tensor whose draws, one piece after another, are the whole tensor's."""
    if numel < 16:
        yield 0, numel
        return
    tail = 16 + numel % 16 if numel % 16 else 0
    head = numel - tail
    for a in range(0, head, CHUNK):
        yield a, min(a + CHUNK, head)
    if tail:
        yield head, numel


def _draw(op: _Op, local: torch.Tensor | None, start: int) -> None:
    """Draw the whole tensor's numbers chunk by chunk; keep the ones in [start, start + local.numel())."""
    end = start + (local.numel() if local is not None else 0)
    for a, b in _chunks(op.numel):
        chunk = torch.empty(b - a, dtype=op.dtype)
        op.func(chunk, *op.rest, **op.kwargs)
        lo, hi = max(a, start), min(b, end)
        if lo < hi:
            local[lo - start : hi - start].copy_(chunk[lo - a : hi - a])


def _apply(op: _Op, local: torch.Tensor, start: int) -> None:
    """An elementwise op on the elements this rank holds (of the whole tensor, or of a view of it)."""
    end = start + local.numel()
    if op.whole:
        lo, hi = start, min(end, op.numel)
        if lo >= hi:
            return
        shape, pick = op.base.shape, slice(0, hi - lo)

        def cut(flat):
            return flat[lo:hi]
    else:
        shape, stride, offset = op.view
        flat_index = torch.arange(op.base.numel()).as_strided(shape, stride, offset).reshape(-1)
        mine = (flat_index >= start) & (flat_index < end)
        if not mine.any():
            return
        pick = (flat_index[mine] - start).to(local.device)

        def cut(flat):
            return flat[mine]

    values = local[pick].to(op.dtype)
    rest = [_part(a, shape, cut, values.device) for a in op.rest]
    op.func(values, *rest, **op.kwargs)
    local[pick] = values.to(local.dtype)


def _part(arg, shape, cut, device):
    """An op's other argument cut to the elements the op runs on (a tensor of the target's shape, or one
    that broadcasts to it); scalars and single-element tensors as they are."""
    if not isinstance(arg, torch.Tensor):
        return arg
    if arg.numel() == 1:
        return arg.to(device)
    return cut(arg.expand(shape).reshape(-1).to(device))
