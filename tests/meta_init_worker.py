"""One rank of tests/test_meta_init.py: models built on meta and filled shard by shard through accelerate's
FSDP2 on gloo (`fsdp2`), or built on meta on every rank but 0 and given rank 0's weights by DDP's wrapping
(`ddp`), each compared with a host build of the same seed in the same process.

    python tests/meta_init_worker.py OUT_FILE fsdp2|ddp  (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)
    (each rank writes OUT_FILE.RANK)
"""

import json
import os
import sys
from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, set_seed

from lmpretrain.model import ModelInit, build_model, mup
from lmpretrain.run.runtime import build_accelerator, layout_of

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
CASES = {  # name: (model type, config fields, dtype, μP base width, a parameter drawn when it is made)
    "llama-tied-pad-float32": ("llama", dict(SMALL, vocab_size=301, pad_token_id=0, tie_word_embeddings=True), "float32", None, False),
    "llama-mup-float64": ("llama", dict(SMALL, vocab_size=300, num_key_value_heads=2), "float64", 32, False),
    "qwen3-moe-float32": ("qwen3_moe", dict(SMALL, vocab_size=300, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), "float32", None, False),
    "randn-parameter": ("llama", dict(SMALL, vocab_size=300), "float32", None, True),
}  # fmt: skip


def make(kind, fields, dtype, base_width, randn):
    model = build_model(AutoConfig.for_model(kind, **fields), dtype=dtype)
    if base_width:
        mup.apply(model, base_width)
    if randn:  # a fork's extra parameter, drawn by its factory call: not replayable on meta
        model.extra = nn.Parameter(torch.randn(5, dtype=model.dtype))
    return model, []


def whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def main() -> None:
    fsdp2 = sys.argv[2] == "fsdp2"
    if fsdp2:
        os.environ.update(
            ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP",
            FSDP_CPU_RAM_EFFICIENT_LOADING="true", FSDP_RESHARD_AFTER_FORWARD="true",
        )  # fmt: skip
    train = SimpleNamespace(
        grad_accum_steps=1, precision="no", fsdp_reduce_dtype="float32", sync_each_micro_batch=False
    )
    accelerator = build_accelerator(train)
    layout = layout_of(accelerator)
    run_cfg = SimpleNamespace(
        model=SimpleNamespace(pretrained=None, ep_size=1), train=SimpleNamespace(fp8="none")
    )
    results = {}
    plugin = accelerator.state.fsdp_plugin if fsdp2 else None
    for name, case in CASES.items():
        if fsdp2:  # per model
            plugin.transformer_cls_names_to_wrap, plugin.auto_wrap_policy = None, transformer_auto_wrap_policy
        set_seed(0)
        host, _ = make(*case)
        host_values = {n: t.clone() for n, t in [*host.named_parameters(), *host.named_buffers()]}
        host_rng = torch.get_rng_state()
        set_seed(0)
        init = ModelInit.for_run(run_cfg, layout, accelerator.process_index)
        model, _ = init.build(lambda case=case: make(*case))
        meta = any(p.is_meta for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters())
        line = init.materialise(model, optimizer, accelerator)[0]
        if not (fsdp2 and init.on_meta):  # FSDP2's meta init has sharded it already
            model, optimizer = accelerator.prepare(model, optimizer)
            model = accelerator.unwrap_model(model)
        values = {n: whole(t).detach() for n, t in [*model.named_parameters(), *model.named_buffers()]}
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        results[name] = {
            "line": line,
            "differ": sorted(n for n in host_values if not torch.equal(values[n], host_values[n])),
            "names": sorted(values) == sorted(host_values),
            "rng_after": torch.equal(torch.get_rng_state(), host_rng),
            "optimizer_holds_the_model": in_optimizer == {id(p) for p in model.parameters()},
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
            "dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
            "built_on_meta": meta,
        }
    with open(f"{sys.argv[1]}.{accelerator.process_index}", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
