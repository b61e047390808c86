"""Each rank's peak host memory and seconds from the start to the model's wrapping (no optimizer state exists
yet): under FSDP2 the model built on meta with each rank filling its own shards, under DDP built on the host by
rank 0 alone and on meta by the others (model/meta_init.py); or with `--host` built whole on every rank, as
before.

    accelerate launch --config_file configs/accelerate/cpu-fsdp.yaml --num_processes 2 \\
        scripts/benchmark_init.py configs/llama-1b.yaml [--host] [--section.field=value ...]

Prints one line per rank and, on rank 0, the whole fp32 model's size for scale.
"""

import sys
import time

START = time.perf_counter()

import torch  # noqa: E402

from lmpretrain.config import load_config  # noqa: E402
from lmpretrain.model import ModelInit, build_model, build_model_config, parameter_counts  # noqa: E402
from lmpretrain.model.meta_init import host_peak_rss_gb  # noqa: E402
from lmpretrain.run import runtime  # noqa: E402


def main() -> None:
    host = "--host" in sys.argv
    cfg = load_config([a for a in sys.argv[1:] if a != "--host"])
    accelerator, info = runtime.setup_from_config(cfg)
    config = build_model_config(cfg.model)
    before = host_peak_rss_gb()  # the imports, the process group
    init = (
        ModelInit("--host: as before")
        if host
        else ModelInit.for_run(cfg, info.layout, accelerator.process_index)
    )
    model, _ = init.build(lambda: (build_model(config, None, cfg.train.param_dtype), []))
    params = parameter_counts(model)["params_total"]
    optimizer = torch.optim.AdamW(model.parameters())  # its state comes at the first step: none here
    line = init.materialise(model, optimizer, accelerator)[0]
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.wait_for_everyone()
    print(
        f"rank {accelerator.process_index} of {accelerator.num_processes}: "
        f"wrapped after "
        f"{time.perf_counter() - START:.1f} s, peak host RSS {host_peak_rss_gb():.2f} GB "
        f"({before:.2f} GB before the build; {line.split(';')[0]})",
        flush=True,
    )
    if accelerator.is_main_process:
        print(f"whole fp32 model: {params:,} parameters, {params * 4 / 1e9:.2f} GB", flush=True)


if __name__ == "__main__":
    main()
