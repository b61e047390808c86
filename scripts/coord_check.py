"""μP's coordinate check: how big each layer's activations and the logits get after a few training steps, at
widths 64 ... 1,024, with and without model.mup (docs/mup.md).

With μP every coordinate stays the same size whatever the width; in the standard parametrisation (the same
lr at every width) the hidden states and logits grow with the width after a few AdamW steps, which is why
an lr tuned on a narrow model diverges or underfits on a wide one.

    python scripts/coord_check.py configs/default.yaml --widths 64,128,256,512,1024 --steps 5 \\
        --out coord.json --plot coord.png

The model is the config's at each width (`model/mup.py: width_overrides`: hidden = width, MLP 8/3 x width
rounded to 64, heads of 32; the config's layers and data), trained by the recipe's own pieces (build, μP, objective, optimizer, lr) on the
config's first training batches, the same at every width; after each step the RMS of every decoder layer's
output and of the logits is measured on a fixed batch. Prints one row per (μP, width)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from lmpretrain.config import load_config
from lmpretrain.data import TrainStream, load_tokenizer
from lmpretrain.model import LMObjective, build_model, build_model_config, make_labels, mup, weighted_sum
from lmpretrain.update import build_optimizer
from lmpretrain.update.schedule import set_lr


def batches(cfg, steps: int) -> list[torch.Tensor]:
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    cfg.data.num_workers = 0
    stream = TrainStream(
        cfg.data, tokenizer, blocks_per_step=cfg.global_batch(1), rank=0, world_size=1, seed=0
    )
    with stream:
        it = iter(stream)
        return [next(it).input_ids for _ in range(steps + 1)], tokenizer


def measure(model, ids: torch.Tensor) -> dict[str, float]:
    """RMS of each decoder layer's output and of the logits on `ids` (no grad)."""
    sizes = {}
    layers = model.model.layers
    hooks = [
        layer.register_forward_hook(lambda m, a, out, i=i: sizes.__setitem__(f"layer_{i}", _rms(out)))
        for i, layer in enumerate(layers)
    ]
    try:
        with torch.no_grad():
            sizes["logits"] = _rms(model(ids).logits)
    finally:
        for h in hooks:
            h.remove()
    return sizes


def _rms(out) -> float:
    t = out[0] if isinstance(out, tuple) else out
    return t.double().pow(2).mean().sqrt().item()


def run(cfg_args: list[str], widths: list[int], steps: int, use_mup: bool, base_width: int) -> list[dict]:
    rows = []
    data, tokenizer = batches(load_config(cfg_args), steps)
    for width in widths:
        cfg = load_config(cfg_args)
        cfg.model.overrides.update(mup.width_overrides(width))
        torch.manual_seed(cfg.run.seed)
        model = build_model(build_model_config(cfg.model, tokenizer), None, cfg.train.param_dtype)
        if use_mup:
            mup.apply(model, base_width, head_dim_fixed=True)
        objective = LMObjective.from_config(cfg, tokenizer.eos_token_id)
        objective.install(model)
        optimizer = build_optimizer(model, cfg.optim)
        fixed = data[-1]  # measured on a batch the steps do not train on
        history = []
        for ids in data[:steps]:
            set_lr(optimizer, cfg.optim.lr)  # the peak lr: the check is about the lr a sweep picks
            labels = make_labels(ids, tokenizer.eos_token_id if cfg.train.mask_cross_doc_targets else None)
            terms = objective(model, ids, labels)
            (weighted_sum(terms) / terms["loss"].count).backward()  # the mean over targets, as the recipe
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            history.append(measure(model, fixed))
        rows.append({"mup": use_mup, "width": width, "steps": history})
        last = history[-1]
        print(
            f"mup={'on ' if use_mup else 'off'} width {width:5d}: after {steps} steps logits RMS {last['logits']:.4g}, "
            f"last layer RMS {last[f'layer_{len(model.model.layers) - 1}']:.4g}",
            flush=True,
        )
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(rows[0]["steps"][-1])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, on in zip(axes, (False, True), strict=True):
        chosen = [r for r in rows if r["mup"] == on]
        for key in keys:
            ax.plot(
                [r["width"] for r in chosen], [r["steps"][-1][key] for r in chosen], marker="o", label=key
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("width")
        ax.set_title(
            f"{'μP' if on else 'standard parametrisation'}: RMS after {len(chosen[0]['steps'])} steps"
        )
    axes[0].set_ylabel("RMS of the activations")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--widths", default="64,128,256,512,1024")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--base-width", type=int, default=64, help="μP's base width (default: the narrowest)")
    parser.add_argument("--out", help="write every measurement as JSON")
    parser.add_argument("--plot", help="write the RMS-vs-width plot (PNG)")
    args, overrides = parser.parse_known_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    rows = []
    for use_mup in (False, True):
        rows += run([args.config, *overrides], widths, args.steps, use_mup, args.base_width)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
