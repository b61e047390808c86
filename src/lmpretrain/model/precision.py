"""Mixed precision that really runs: autocast plus dynamic loss scaling for fp16, on any device.

accelerate ignores mixed_precision="fp16" on CPU (no scaler, plain fp32), so the recipe owns
autocast and the GradScaler itself and checks at start-up that the requested dtype is really used.
Under DeepSpeed the engine owns precision instead (16-bit weights, fp32 master copies, its own loss
scaler): this class then only reports the dtype and checks the engine's weights really use it.
Under FSDP2 the gradients are DTensor shards and each rank checks only its own; torch's DTensor dispatch
of the scaler's inf/NaN check all-reduces the found-inf flag (max over the mesh), so one rank's
overflow skips the step and backs off the scale on every rank (tests/test_fsdp.py checks exactly that).
"""

from __future__ import annotations

import contextlib

import torch

from lmpretrain.errors import PrecisionUnavailableError
from lmpretrain.layout import Layout
from lmpretrain.model.sharded_precision import check_sharded_precision

DTYPES = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class MixedPrecision:
    """`autocast()` for forward passes; `scale`/`unscale_`/`step` implement fp16 loss scaling.

    For bf16 and fp32 the scaler methods are pass-throughs, so the loop reads the same for all three.
    """

    def __init__(
        self, precision: str, device: torch.device, init_scale: float = 2.0**16, engine: bool = False
    ):
        self.precision = precision
        self.device_type = device.type
        self.dtype = DTYPES[precision]
        self.engine = engine  # DeepSpeed: autocast and scaling are the engine's
        own_scaler = precision == "fp16" and not engine
        self.scaler = torch.amp.GradScaler(self.device_type, init_scale=init_scale) if own_scaler else None
        if self.dtype is not None and not engine:
            self._check_autocast(device)

    @classmethod
    def from_config(cls, train, device: torch.device, engine: bool = False) -> MixedPrecision:
        """The precision train.precision / train.loss_scale_init ask for (`engine`: under DeepSpeed)."""
        return cls(train.precision, device, train.loss_scale_init, engine=engine)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the forward's matmuls run in: the autocast dtype, else float32 (for the MFU's peak)."""
        return self.dtype or torch.float32

    def check_prepared(self, model, optimizer, train, layout: Layout) -> list[str]:
        """After accelerator.prepare, the start-up line on what precision really runs where a wrapper owns
        it: FSDP2's mixed-precision policy (every rank: the check runs a forward of a few tokens) or the
        DeepSpeed engine's weights; none otherwise."""
        if layout.kind == "fsdp2":
            return [check_sharded_precision(model, optimizer, train)]
        if layout.kind == "deepspeed":
            return [self.check_engine_weights(model)]
        return []

    def check_engine_weights(self, model) -> str:
        """Under DeepSpeed: refuse a silent fp32 run (the engine casts the weights it trains); returns
        what really runs, for the log."""
        dtypes = sorted(
            {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()}
        )
        if self.dtype is not None and dtypes != [str(self.dtype).removeprefix("torch.")]:
            raise PrecisionUnavailableError(
                f"train.precision={self.precision} requested, but the DeepSpeed engine holds {dtypes} weights; "
                "refusing to run a silent fp32 run"
            )
        # ZeRO keeps float32 master weights and moments whatever the weights' dtype (float64 included).
        return f"DeepSpeed precision: weights {'/'.join(dtypes)}, master weights and optimizer state float32"

    def _check_autocast(self, device: torch.device) -> None:
        a = torch.ones(8, 8, device=device)
        try:
            with self.autocast():
                out = a @ a
        except RuntimeError as err:
            raise PrecisionUnavailableError(
                f"train.precision={self.precision}: autocast to {self.dtype} fails on {device}: {err}"
            ) from err
        if out.dtype != self.dtype:
            raise PrecisionUnavailableError(
                f"train.precision={self.precision} requested, but autocast on {device} computes in {out.dtype}; "
                "refusing to run a silent fp32 run (use --train.precision=no)"
            )

    def autocast(self):
        if self.dtype is None or self.engine:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler else loss

    def unscale_(self, optimizer) -> None:
        """Divide gradients by the scale in place; call before clipping so the norm is the real one."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer, skip: bool = False) -> bool:
        """Step the optimizer unless `skip` or fp16 gradients overflowed; returns whether it really stepped.

        A skipped step still updates the fp16 loss scale from the overflow check `unscale_` made, so
        the scaler backs off after inf/NaN gradients whoever decided to skip.
        """
        if not self.scaler:
            if not skip:
                optimizer.step()
            return not skip
        before = self.scaler.get_scale()
        if not skip:
            self.scaler.step(optimizer)  # skipped internally when a gradient is inf/NaN
        self.scaler.update()  # halves the scale after an overflow, doubles it after growth_interval clean steps
        return not skip and self.scaler.get_scale() >= before

    @property
    def backs_off_overflows(self) -> bool:
        """Whether an fp16 loss scaler answers inf/NaN gradients by halving its scale: ours while the
        scale is >= 1 (below it gradients overflow at their true size), DeepSpeed's always (it stops the
        run itself at its minimum scale)."""
        return self.precision == "fp16" and (self.engine or self.scaler.get_scale() >= 1)

    @property
    def loss_scale(self) -> float | None:
        return self.scaler.get_scale() if self.scaler else None

    def state_dict(self) -> dict | None:
        return self.scaler.state_dict() if self.scaler else None

    def load_state_dict(self, state: dict | None) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)
