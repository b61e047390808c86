"""FLOPs per token from the model config, the device's peak FLOP/s, and MFU.

MFU = achieved model FLOP/s / peak FLOP/s, where the model FLOPs are counted from the architecture
(not measured), so activation recomputation, padding or wasted work never raise it.

Counting convention (PaLM, Chowdhery et al. 2022, appendix B; nanoGPT's ``estimate_mfu``):

* a matmul ``[T, a] x [a, b]`` costs ``2 * T * a * b`` FLOPs (one multiply + one add);
* forward per token = ``2 * matmul_params + attention``, where ``matmul_params`` are the weight
  matrices used per token (attention projections, MLP, and the LM head, tied or not); biases, norms
  and the embedding *lookups* are left out (they are not matmuls);
* ``attention = 2 * 2 * n_layers * seq_len * d_attn`` for ``QK^T`` and ``AV`` with
  ``d_attn = n_heads * head_dim`` (query heads: with GQA each query head still computes its own
  scores and weighted sum);
* **causal convention**: by default the full ``seq_len x seq_len`` score matrix is counted, as PaLM
  and nanoGPT do; the work a causal mask really needs is about half of it (query ``i`` sees ``i + 1``
  keys). ``causal=True`` counts only that, ``(seq_len + 1) / 2`` keys on average;
* training = forward + backward = ``3 * forward`` (backward = 2x forward: grads w.r.t. inputs and
  weights).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lmpretrain.gpus import gpu_for_device

# --------------------------------------------------------------------------------------------
# FLOPs per token
# --------------------------------------------------------------------------------------------

_LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3", "olmo", "olmo2", "gemma", "gemma2")


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        value = cfg.get(name, default)
    else:
        value = getattr(cfg, name, default)
    return default if value is None else value


def _require(cfg: Any, *names: str) -> list[int]:
    values = [_get(cfg, n) for n in names]
    missing = [n for n, v in zip(names, values, strict=True) if v is None]
    if missing:
        raise ValueError(f"model config lacks {missing} needed to count FLOPs")
    return [int(v) for v in values]


def matmul_params_per_token(model_config: Any) -> tuple[int, int, int]:
    """Weights used as matmuls per token, incl. the LM head: returns (params, n_layers, d_attn)."""
    model_type = str(_get(model_config, "model_type", ""))
    if model_type == "gpt2":
        d, n_layers, vocab = _require(model_config, "n_embd", "n_layer", "vocab_size")
        d_ff = int(_get(model_config, "n_inner", 4 * d))
        attention = d * 3 * d + d * d  # c_attn (q, k, v fused) + c_proj
        mlp = 2 * d * d_ff  # c_fc + c_proj
        return n_layers * (attention + mlp) + d * vocab, n_layers, d
    if model_type in _LLAMA_STYLE:
        d, n_layers, n_heads, d_ff, vocab = _require(
            model_config,
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
        n_kv = int(_get(model_config, "num_key_value_heads", n_heads))
        head_dim = int(_get(model_config, "head_dim", d // n_heads))
        d_q, d_kv = n_heads * head_dim, n_kv * head_dim
        attention = d * d_q + 2 * d * d_kv + d_q * d  # q, k, v (GQA: fewer kv heads), o
        mlp = 3 * d * d_ff  # gated MLP: gate, up, down
        return n_layers * (attention + mlp) + d * vocab, n_layers, d_q
    raise ValueError(
        f"cannot count FLOPs for model_type {model_type!r}: supported are 'gpt2' and the Llama-style "
        f"{list(_LLAMA_STYLE)}. Add it to lmpretrain.observe.flops.matmul_params_per_token, or count its "
        "matmul weights yourself and call flops_per_token_from_counts()."
    )


def flops_per_token_from_counts(
    matmul_params: int, n_layers: int, seq_len: int, d_attn: int, *, causal: bool = False
) -> float:
    """Training FLOPs per token (forward + backward) from counts; see the module docstring."""
    keys = (seq_len + 1) / 2 if causal else seq_len
    forward = 2 * matmul_params + 2 * 2 * n_layers * keys * d_attn
    return 3.0 * forward


def train_flops_per_token(model_config: Any, seq_len: int, *, causal: bool = False) -> float:
    """Training FLOPs per token of a transformers config (or dict with the same fields)."""
    params, n_layers, d_attn = matmul_params_per_token(model_config)
    return flops_per_token_from_counts(params, n_layers, seq_len, d_attn, causal=causal)


def counted_flops_per_token(model_config: Any, seq_len: int) -> float:
    """Training FLOPs per token counted by torch's FLOP counter: one forward + backward of the model
    built on the meta device (shapes only: no memory, no compute), over one block of `seq_len` tokens.

    Mixtures of experts are refused: their grouped expert matmuls are not counted by torch's counter.
    """
    from torch.utils.flop_counter import FlopCounterMode

    model = _meta_model(model_config)
    if any(_active_fraction(p, model_config) < 1 for p in model.parameters()):
        raise ValueError("torch's FLOP counter does not count a mixture of experts' grouped matmuls")
    tokens = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        # use_cache=True: without a cache transformers looks for packed sequences in the position ids
        # with .item(), which a meta tensor cannot answer.
        logits = model(input_ids=tokens, use_cache=True).logits
        logits.float().sum().backward()
    return counter.get_total_flops() / seq_len


def parameter_flops_per_token(model_config: Any, seq_len: int) -> float:
    """6N + attention: N counts the weights used as matmuls per token -- every >= 2-D parameter except
    embedding tables, plus the LM head even when tied -- with a mixture of experts' stacked expert
    weights scaled to the num_experts_per_tok experts each token is routed to."""
    model = _meta_model(model_config)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    params = sum(
        p.numel() * _active_fraction(p, model_config)
        for p in model.parameters()
        if p.dim() >= 2 and id(p) not in tables
    )
    head = model.get_output_embeddings()
    if head is not None and id(head.weight) in tables:  # tied: the table is also the output matmul
        params += head.weight.numel()
    n_layers, n_heads, hidden = _require(
        model_config, "num_hidden_layers", "num_attention_heads", "hidden_size"
    )
    d_attn = n_heads * int(_get(model_config, "head_dim", hidden // n_heads))
    return flops_per_token_from_counts(round(params), n_layers, seq_len, d_attn)


def _meta_model(model_config: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        # Eager attention: plain matmuls every model has, and that any counter sees.
        return AutoModelForCausalLM.from_config(model_config, attn_implementation="eager")


def _active_fraction(param: torch.Tensor, model_config: Any) -> float:
    """k / E for a stacked expert weight [E, ...] of a top-k mixture of experts, else 1."""
    experts = next(
        (
            _get(model_config, name)
            for name in ("num_local_experts", "num_experts", "n_routed_experts")
            if _get(model_config, name)
        ),
        None,
    )
    top_k = _get(model_config, "num_experts_per_tok")
    if param.dim() == 3 and experts and top_k and param.shape[0] == experts:
        return top_k / experts
    return 1.0


def flops_per_token(model_config: Any, seq_len: int) -> tuple[float | None, str]:
    """Training FLOPs per token and where the number comes from, trying in turn the architecture
    formula (gpt2 and Llama-style types), torch's FLOP counter on the meta device, and 6N + attention.
    Never raises: a metric must not stop a run, so when nothing can count them it returns
    (None, why) and the run logs no MFU."""
    methods = (
        ("architecture formula", train_flops_per_token),
        ("torch FLOP counter on the meta device", counted_flops_per_token),
        ("6N + attention from the parameters", parameter_flops_per_token),
    )
    failures = []
    for source, method in methods:
        try:
            value = float(method(model_config, seq_len))
        except Exception as err:  # noqa: BLE001 - any failure here means: try the next way
            first_line = (str(err).splitlines() or [""])[0]
            failures.append(f"{source}: {type(err).__name__}: {first_line[:160]}")
            continue
        if value > 0:
            return value, source
        failures.append(f"{source}: counted {value}")
    return None, "could not count training FLOPs per token, so perf/mfu is not logged (" + "; ".join(
        failures
    ) + ")"


# --------------------------------------------------------------------------------------------
# Peak FLOP/s
# --------------------------------------------------------------------------------------------

# The datasheet peaks are the one GPU table's (lmpretrain/gpus.yaml: dense figures, sources there), which the
# planner reads too; "tf32" is used for fp32 matmuls when torch allows TF32.
_DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    "no": "fp32",
    "fp32": "fp32",
    "float32": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
}
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_key(dtype: torch.dtype | str) -> str:
    """'fp32' | 'bf16' | 'fp16' for a torch dtype or a precision name ('no', 'bf16', 'fp16', ...)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {dtype!r}: use float32/bfloat16/float16 or no/bf16/fp16"
        ) from None


def table_dtype(dtype: torch.dtype | str, *, allow_tf32: bool = False, fp8: bool = False) -> str:
    """The table's dtype for a run's matmuls: fp8 where train.fp8 runs torchao's float8 kernels (the blocks'
    large Linears), tf32 for fp32 matmuls that torch lets use TF32, else the compute dtype's."""
    dt = dtype_key(dtype)
    if fp8:
        return "fp8"
    return "tf32" if dt == "fp32" and allow_tf32 else dt


def gpu_table_key(device_name: str) -> str | None:
    """The GPU table's entry for a CUDA device name, or None when it is not in the table."""
    gpu = gpu_for_device(device_name)
    return gpu.key if gpu else None


def table_peak(
    device_name: str, dtype: torch.dtype | str, *, allow_tf32: bool = False, fp8: bool = False
) -> float | None:
    """Datasheet peak FLOP/s for a GPU name and dtype (see table_dtype), or None when unknown."""
    gpu = gpu_for_device(device_name)
    return gpu.peak_flops(table_dtype(dtype, allow_tf32=allow_tf32, fp8=fp8)) if gpu else None


def gpu_peak(
    device_name: str, dtype: torch.dtype | str, *, allow_tf32: bool = False, fp8: bool = False
) -> tuple[float, str] | None:
    """A CUDA device's peak from the GPU table and its source (`table:<entry>:<dtype>`), None when unknown."""
    value = table_peak(device_name, dtype, allow_tf32=allow_tf32, fp8=fp8)
    used = table_dtype(dtype, allow_tf32=allow_tf32, fp8=fp8)
    return None if value is None else (value, f"table:{gpu_table_key(device_name)}:{used}")


@functools.cache
def measure_peak_flops(device: str, dtype_name: str, seconds: float = 1.0, max_n: int = 2048) -> float:
    """Best observed FLOP/s of a square matmul in ``dtype`` on ``device``, over about ``seconds``.

    The size doubles from 256 until one matmul takes >= 50 ms (or ``max_n``), so slow dtypes (fp16 on
    CPU runs at ~1 GFLOP/s) stay quick and fast ones are measured at a size that saturates the
    device. Cached: a run measures once per (device, dtype). On CPU this is what the BLAS really
    reaches with the current thread count -- an honest ceiling, not a datasheet number.
    """
    dev = torch.device(device)
    dtype = _TORCH_DTYPES[dtype_name]

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(a: torch.Tensor, b: torch.Tensor) -> float:
        t0 = time.perf_counter()
        torch.matmul(a, b)
        sync()
        return time.perf_counter() - t0

    start = time.perf_counter()
    n = 256
    with torch.no_grad():
        while True:
            a = torch.randn(n, n, device=dev).to(dtype)
            b = torch.randn(n, n, device=dev).to(dtype)
            timed(a, b)  # warm-up: allocation, kernel selection
            best = timed(a, b)
            if best >= 0.05 or n >= max_n:
                break
            n *= 2
        while time.perf_counter() - start < seconds:
            best = min(best, timed(a, b))
    return 2.0 * n**3 / best


def peak_flops(
    device: torch.device | str, dtype: torch.dtype | str, *, fp8: bool = False
) -> tuple[float, str]:
    """Peak FLOP/s of one device for matmuls in ``dtype`` (``fp8``: torchao's float8 kernels, train.fp8), and
    where the number comes from.

    Known GPUs: the GPU table, source ``table:<entry>:<dtype>`` (``tf32`` when fp32 matmuls may use TF32,
    ``fp8`` for an fp8 run); unknown GPUs and CPUs: measured once per run with a large matmul in ``dtype``,
    source ``measured:<device>:<dtype>`` (an fp8 run there is measured against that dtype, and says so).
    """
    device = torch.device(device)
    dt = dtype_key(dtype)
    dtype_name = str(_TORCH_DTYPES[dt]).removeprefix("torch.")
    unmeasured = " (no fp8 peak known for it: against this dtype's)" if fp8 else ""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        allow_tf32 = (
            torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
        )
        known = gpu_peak(name, dt, allow_tf32=allow_tf32, fp8=fp8)
        if known is not None:
            return known
        # Not in the table: measure, with a matmul big enough to saturate a GPU.
        measured = measure_peak_flops(str(device), dt, max_n=8192)
        return measured, f"measured:cuda:{name}:{dtype_name}{unmeasured}"
    # On CPUs a 1024-square matmul for 0.3 s finds the same best rate as 2048 for 1 s (55-71 against
    # 55-65 GFLOP/s on one thread, 102-112 against 103-122 on two, this repo's 2-core machine) in ~0.3 s
    # instead of ~1.1 s of every run's start-up.
    return measure_peak_flops(
        str(device), dt, seconds=0.3, max_n=1024
    ), f"measured:{device.type}:{dtype_name}{unmeasured}"


def mfu(tokens_per_s: float, flops_per_token: float, peak: float, num_devices: int = 1) -> float:
    """Model FLOPs utilisation: ``tokens_per_s * flops_per_token / (peak * num_devices)``.

    Pass global tokens/s with ``num_devices = world size``, or per-device tokens/s with 1.
    """
    if peak <= 0 or num_devices <= 0:
        raise ValueError(f"peak ({peak}) and num_devices ({num_devices}) must be positive")
    return tokens_per_s * flops_per_token / (peak * num_devices)


@dataclass
class MFUMeter:
    """A run's MFU basis: training FLOPs per token (None when nothing could count them) and the
    device's peak FLOP/s, each with its source."""

    flops_per_token: float | None
    flops_source: str
    peak: float
    peak_source: str

    @classmethod
    def for_run(
        cls, model_config: Any, cfg, device: torch.device, dtype: torch.dtype, extra_matmul_params: int = 0
    ) -> MFUMeter:
        """The run's (cfg: its Config) FLOPs per token at data.seq_len, and the peak of the matmuls it runs:
        `dtype`'s, or with train.fp8 the fp8 peak (torchao's float8 kernels run the blocks' large Linears).
        `extra_matmul_params`: weights the objective uses as matmuls per token beyond the model's forward (a
        fork's auxiliary modules, `LMObjective.extra_matmul_params`), 6 FLOPs each per token."""
        flops, source = flops_per_token(model_config, cfg.data.seq_len)
        if flops is not None and extra_matmul_params:
            flops += 6.0 * extra_matmul_params
            source += f" + 6 x {extra_matmul_params:,} weights of the objective's auxiliary modules"
        return cls(flops, source, *peak_flops(device, dtype, fp8=cfg.train.fp8 != "none"))

    def describe(self) -> str:
        if self.flops_per_token is None:
            return f"WARNING: {self.flops_source}"
        return (
            f"training FLOPs per token: {self.flops_per_token:.4g} ({self.flops_source}); perf/mfu against a "
            f"peak of {self.peak:.4g} FLOP/s ({self.peak_source})"
        )

    def facts(self) -> dict:
        """For the run config: both numbers and where they come from."""
        return {
            "flops_per_token": self.flops_per_token,
            "flops_per_token_source": self.flops_source,
            "peak_flops": self.peak,
            "peak_flops_source": self.peak_source,
        }

    def metrics(self, tokens_per_s_per_device: float) -> dict:
        """`perf/mfu`, or nothing when FLOPs per token are unknown."""
        if self.flops_per_token is None:
            return {}
        return {"perf/mfu": mfu(tokens_per_s_per_device, self.flops_per_token, self.peak)}
