"""A step that runs out of memory is redone with half the micro-batch and twice the accumulation.

The step's global batch is already drawn (the data position advanced once), so the redo trains on the same
rows, split into smaller micro-batches: the loss is normalised by the whole batch's target count, so the
update is the same up to summation order. Out of memory is torch.OutOfMemoryError on CUDA and, on CPU, the
allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory", e.g. under an address-space limit)
or Python's MemoryError. The halving stays for the rest of the run (later steps would run out too).

Not redone, re-raised as before: an error once the optimizer step has begun (weights may be half-updated),
under DeepSpeed (its engine fixes the accumulation when it is built), with more than one process (the other
ranks are waiting inside a collective the redo would not match), and at micro-batch 1.
"""

from __future__ import annotations

import gc

import torch
from accelerate.utils import DistributedType

from lmpretrain.run.runtime import set_grad_accum

_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory")


def is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in _MESSAGES)


def smaller_micro_batch(micro: int) -> int:
    """Half of `micro`, or the largest divisor below half, so every batch (a multiple of it) still splits."""
    return next(d for d in range(micro // 2, 0, -1) if micro % d == 0)


def halve_on_oom(train_step, model, optimizer, *args, train, say, accelerator, **kwargs):
    """`train_step(model, optimizer, *args, accelerator=accelerator, **kwargs)`, redone from the same batch
    at a smaller micro-batch (train.micro_batch_size and grad_accum_steps updated) while it runs out of
    memory before the update; says so in one line each time."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper steps the torch optimizer
    alone = accelerator.num_processes == 1 and accelerator.distributed_type != DistributedType.DEEPSPEED
    updating: list[bool] = []  # set once the optimizer step begins
    while True:
        updating.clear()
        hook = inner.register_step_pre_hook(lambda *_: updating.append(True)) if alone else None
        try:
            return train_step(model, optimizer, *args, accelerator=accelerator, **kwargs)
        except Exception as err:
            if not (alone and is_out_of_memory(err) and not updating and train.micro_batch_size > 1):
                raise
            what = str(err).splitlines()[0][:200]
        finally:
            if hook is not None:
                hook.remove()
        # Out of the except block: the traceback and the activations its frames held are released.
        optimizer.zero_grad(set_to_none=True)  # the failed micro-batches' partial gradients
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        micro, accum = train.micro_batch_size, accelerator.gradient_accumulation_steps
        smaller = smaller_micro_batch(micro)
        factor = micro // smaller
        train.micro_batch_size, train.grad_accum_steps = smaller, train.grad_accum_steps * factor
        set_grad_accum(accelerator, accum * factor)
        say(
            f"out of memory ({what}): micro-batch {micro} -> {smaller}, accumulation {accum} -> "
            f"{accum * factor}; redoing this step from the same batch"
        )
