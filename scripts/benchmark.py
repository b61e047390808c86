#!/usr/bin/env python
"""Tokens/s, peak memory and compile time of the recipe with each speed switch, against a lean reference.

    python scripts/benchmark.py configs/default.yaml [--steps 20] [--warmup 5] [--rounds 2] [--threads 0]
                                [--shapes config,gpt2,chars] [--best SWITCH,...] [--to-target STEPS]
                                [--recipe-args='--optim.name=muon ...'] [--section.field=value ...]

For three model shapes (the config's own; a GPT-2 of 4 layers x 4 heads x 128 wide on 64-token blocks,
12 rows per micro-batch, on the config's data and tokenizer; and the same GPT-2 with a character-level
tokenizer of 65 symbols, `builtin:python-stdlib-chars`, where the transformer blocks, not the output
head, dominate a step) it prints one table: the recipe with every switch off ("eager"), each switch
alone, the best combination (the switches that were faster alone, activation checkpointing excepted:
it buys memory with compute; or the ones `--best` names, skipping the single-switch rounds), and a lean
reference: a minimal hand-written model of the same shape in plain PyTorch
(F.scaled_dot_product_attention, fused AdamW, no transformers), trained on the same batches, already in
memory, with the recipe's hyper-parameters and lr schedule; then best / eager and recipe / lean reference.

The recipe runs are real `accelerate launch` runs (of recipes/pretrain.py through this script, which only
adds the process's CPU seconds to each metrics row), timed between metrics rows after `--warmup` steps
(compilation happens there), so everything the loop does counts; evaluation and checkpoints are off
(periodic costs, not per-step ones). Two clocks: the wall clock (a run's speed is its 25th-percentile
step: on a shared machine the slower steps are the ones other processes slowed) and the CPU clock
(median CPU seconds of a step, every thread of the process: what the step cost, whoever else had the
cores). Each run is measured once per round, odd rounds in reverse order; eager, best and the lean
reference run side by side (the ratios pair runs next to each other). The table gives medians, the
spread and the load average.

`--to-target N`: the lean reference trains N steps of the config's schedule and its held-out loss is the
target; the recipe (best) trains the same N steps, tokens per step and schedule, evaluated every N/10
steps; its steps to the target times its step time relative to the lean reference's (side by side,
both clocks) give its time to the target relative to the lean reference's. `--recipe-args=...` gives the
recipe's runs (timed and to the target) overrides the lean reference does not get, e.g. another
optimizer: the target stays the lean reference's with AdamW.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from torch import nn

from lmpretrain.config import load_config
from lmpretrain.data import TrainStream, heldout_blocks
from lmpretrain.data.tokenizer import load_tokenizer
from lmpretrain.model.build import build_model_config
from lmpretrain.run.runtime import configure_threads
from lmpretrain.update import learning_rate

ROOT = Path(__file__).resolve().parents[1]
# No dropout, like the lean reference (GPT-2's default is 0.1).
GPT2 = {"n_embd": 128, "n_layer": 4, "n_head": 4, "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0}
GPT2 |= {"attn_pdrop": 0.0}
CHARS = "builtin:python-stdlib-chars"  # 65 symbols: the blocks, not the output head, dominate a step
OFF = {
    "train.compile": False,
    "train.activation_checkpointing": "none",
    "train.loss_impl": "full",
    "optim.fused": False,
    "model.attn_implementation": "eager",
}
SWITCHES = {
    "compile": {"train.compile": True},
    "activation checkpointing": {"train.activation_checkpointing": "full"},
    "chunked loss": {"train.loss_impl": "chunked"},
    "fused AdamW": {"optim.fused": True},
    "sdpa attention": {"model.attn_implementation": "sdpa"},
}


def fastest_quarter(step_times: list[float]) -> float:
    """The 25th percentile step time: on a shared machine the slower steps are the ones others slowed."""
    return statistics.quantiles(step_times, n=4)[0]


# ---- the lean reference: a minimal GPT-2 or Llama in plain PyTorch ---------------------------------


class LeanBlock(nn.Module):
    def __init__(self, llama: bool, width: int, heads: int, kv_heads: int, ffn: int, eps: float):
        super().__init__()
        self.llama, self.heads, self.kv_heads, self.head_dim = llama, heads, kv_heads, width // heads
        norm = (lambda: nn.RMSNorm(width, eps=eps)) if llama else (lambda: nn.LayerNorm(width, eps=eps))
        self.norm1, self.norm2 = norm(), norm()
        self.qkv = nn.Linear(width, (heads + 2 * kv_heads) * self.head_dim, bias=not llama)
        self.proj = nn.Linear(width, width, bias=not llama)
        self.up = nn.Linear(width, 2 * ffn if llama else ffn, bias=not llama)  # Llama: gate and up together
        self.down = nn.Linear(ffn, width, bias=not llama)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.llama:  # rotary embeddings (rotate-half form)
            q, k = (
                t * cos + torch.cat([-t[..., t.size(-1) // 2 :], t[..., : t.size(-1) // 2]], -1) * sin
                for t in (q, k)
            )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
        h = self.up(self.norm2(x))
        if self.llama:
            gate, up = h.chunk(2, dim=-1)
            return x + self.down(F.silu(gate) * up)
        return x + self.down(F.gelu(h, approximate="tanh"))


class LeanLM(nn.Module):
    """The shape of a transformers GPT-2 or Llama config, tied embeddings, nothing else."""

    def __init__(self, config):
        super().__init__()
        self.llama = config.model_type == "llama"
        width, heads, layers = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
        if self.llama:
            kv, ffn, eps = config.num_key_value_heads, config.intermediate_size, config.rms_norm_eps
            theta = config.rope_parameters["rope_theta"]
            inv_freq = 1.0 / theta ** (torch.arange(0, width // heads, 2).float() / (width // heads))
            angles = torch.outer(torch.arange(config.max_position_embeddings).float(), inv_freq)
            self.register_buffer("cos", torch.cat([angles, angles], -1).cos(), persistent=False)
            self.register_buffer("sin", torch.cat([angles, angles], -1).sin(), persistent=False)
        else:
            kv, ffn, eps = heads, config.n_inner or 4 * width, config.layer_norm_epsilon
            self.positions = nn.Embedding(config.n_positions, width)
        self.embed = nn.Embedding(config.vocab_size, width)
        self.blocks = nn.ModuleList(LeanBlock(self.llama, width, heads, kv, ffn, eps) for _ in range(layers))
        self.norm = nn.RMSNorm(width, eps=eps) if self.llama else nn.LayerNorm(width, eps=eps)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids):
        T = ids.size(1)
        x = self.embed(ids)
        cos = sin = None
        if self.llama:
            cos, sin = self.cos[:T], self.sin[:T]
        else:
            x = x + self.positions(torch.arange(T, device=ids.device))
        for block in self.blocks:
            x = block(x, cos, sin)
        return F.linear(self.norm(x), self.embed.weight)


def lean_step(model, optimizer, batch, B: int, K: int, max_norm: float) -> None:
    """The lean reference's optimizer step: K micro-batches of B rows, mean loss / K, clip, AdamW."""
    for x in batch.split(B):
        logits = model(x)
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        (loss / K).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def lean(config_path: str, overrides: list[str], steps: int, warmup: int, eval_every: int = 0) -> dict:
    """Tokens/s of the lean model on the recipe's first batches (in memory): fused AdamW with the recipe's
    hyper-parameters, weight-decay groups and lr schedule. With `eval_every`, also its held-out loss every
    that many steps and at the end (the recipe's held-out set and loss: sum over targets / targets)."""
    cfg = load_config([config_path, *overrides])
    threads = configure_threads(cfg.run.threads, 1)
    B, K, T = cfg.train.micro_batch_size, cfg.train.grad_accum_steps, cfg.data.seq_len
    data = dataclasses.replace(cfg.data, num_workers=0)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    stream = TrainStream(data, tokenizer, blocks_per_step=B * K, rank=0, world_size=1, seed=cfg.run.seed)
    batches = [step.input_ids for step, _ in zip(stream, range(warmup + steps), strict=False)]
    stream.close()
    held_out = None
    if eval_every:
        held_out = heldout_blocks(cfg.data, tokenizer, num_blocks=cfg.eval.batches * cfg.eval.batch_size)
    torch.manual_seed(cfg.run.seed)
    model = LeanLM(build_model_config(cfg.model))
    o = cfg.optim
    matrices = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith(("embed", "pos"))]
    others = [p for p in model.parameters() if all(p is not q for q in matrices)]
    groups = [{"params": matrices, "weight_decay": o.weight_decay}, {"params": others, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
    times, cpu_times, curve = [], [], {}

    @torch.no_grad()
    def evaluate(step):
        model.eval()
        total = sum(
            F.cross_entropy(
                model(x)[:, :-1].float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum"
            ).item()
            for x in held_out.split(cfg.eval.batch_size)
        )
        curve[step] = total / held_out[:, 1:].numel()
        model.train()

    for step, batch in enumerate(batches):
        start, cpu_start = time.perf_counter(), time.process_time()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        lean_step(model, optimizer, batch, B, K, cfg.train.max_grad_norm)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        if eval_every and ((step + 1) % eval_every == 0 or step + 1 == len(batches)):
            evaluate(step + 1)
    return {
        "tokens_per_s": B * K * T / fastest_quarter(times[warmup:]),
        "tokens_per_cpu_s": B * K * T / statistics.median(cpu_times[warmup:]),
        "train_s": sum(times),
        "eval_loss": curve,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "threads": threads,
        "params": sum(p.numel() for p in model.parameters()),
    }


# ---- the recipe ------------------------------------------------------------------------------------


def recipe(
    config_path: str, overrides: list[str], switches: dict, steps: int, warmup: int, eval_every: int = 0
):
    """Wall-clock tokens/s of `accelerate launch recipes/pretrain.py` between its metrics rows (fastest
    quarter of the steps after `warmup`). With `eval_every`, a run of the config's own schedule (warmup
    included) with its held-out loss every that many steps, and its seconds of training (the steps'
    own `perf/step_time_s`, evaluations left out)."""
    timing = (
        ["--eval.every=0", "--optim.warmup_steps=1"] if not eval_every else [f"--eval.every={eval_every}"]
    )
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            str(Path(sys.executable).with_name("accelerate")),
            "launch",
            "--config_file",
            str(ROOT / "configs/accelerate/cpu.yaml"),
            __file__,
            "--recipe",
            config_path,
            f"--run.output_dir={out}/run",
            f"--train.max_steps={warmup + steps}",
            *timing,
            "--eval.sample_tokens=0",
            "--checkpoint.every=0",
            "--logging.wandb_mode=disabled",
            *overrides,
            *[f"--{key}={json.dumps(value)}" for key, value in switches.items()],
        ]
        if not eval_every:
            cmd.append("--eval.batches=1")
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        subprocess.run(
            cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        rows = [json.loads(line) for line in open(f"{out}/run/metrics.jsonl")]
    curve = {r["step"]: r["eval/loss"] for r in rows if "eval/loss" in r}
    rows = [r for r in rows if "train/loss" in r]
    timed = rows[max(warmup - 1, 0) :]
    tokens_per_step = rows[0]["perf/tokens_per_s"] * rows[0]["perf/step_time_s"]
    step = fastest_quarter(
        [b["_timestamp"] - a["_timestamp"] for a, b in zip(timed, timed[1:], strict=False)]
    )
    cpu_step = statistics.median(
        [b["perf/cpu_s"] - a["perf/cpu_s"] for a, b in zip(timed, timed[1:], strict=False)]
    )
    return {
        "tokens_per_s": tokens_per_step / step,
        "tokens_per_cpu_s": tokens_per_step / cpu_step,
        "train_s": sum(r["perf/step_time_s"] for r in rows),
        "step_times": [r["perf/step_time_s"] for r in rows],
        "eval_loss": curve,
        "peak_rss_bytes": rows[-1]["perf/peak_mem_bytes"],
        "compile_s": next((r["perf/compile_s"] for r in rows if "perf/compile_s" in r), None),
    }


def eval_seconds(config_path: str, overrides: list[str], loss_impl: str, repeats: int = 3) -> float:
    """Fastest of `repeats` evaluations of the config's held-out set (eval.batches x eval.batch_size
    blocks) with `loss_impl`, through the recipe's Evaluator, in this process."""
    from accelerate import Accelerator

    from lmpretrain.model import LMObjective, MixedPrecision, build_model
    from lmpretrain.model.objective import install_loss_forward
    from lmpretrain.observe import Evaluator

    cfg = load_config([config_path, *overrides, f"--train.loss_impl={loss_impl}"])
    configure_threads(cfg.run.threads, 1)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    blocks = heldout_blocks(cfg.data, tokenizer, num_blocks=cfg.eval.batches * cfg.eval.batch_size)
    torch.manual_seed(cfg.run.seed)
    model = build_model(build_model_config(cfg.model, tokenizer), None, cfg.train.param_dtype)
    install_loss_forward(model)
    objective = LMObjective.from_config(cfg, tokenizer.eos_token_id)
    precision = MixedPrecision(cfg.train.precision, torch.device("cpu"))
    evaluator = Evaluator(blocks, objective, precision, cfg.eval.batch_size, Accelerator(cpu=True))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        evaluator(model)
        times.append(time.perf_counter() - start)
    return min(times)


def run_recipe_with_cpu_clock(argv: list[str]) -> None:
    """recipes/pretrain.py as `accelerate launch` runs it, each metrics row also holding `perf/cpu_s`: the
    process's CPU seconds so far (every thread). On a shared machine a step's CPU time is what the step
    cost; its wall time also holds the time other processes had the cores."""
    from lmpretrain.observe.tracking import Tracker

    log = Tracker.log

    def log_with_cpu_clock(self, metrics: dict, step: int) -> None:
        log(
            self, {**metrics, "perf/cpu_s": time.process_time()} if "train/loss" in metrics else metrics, step
        )

    Tracker.log = log_with_cpu_clock
    sys.argv = [str(ROOT / "recipes/pretrain.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


def measure(name: str, run) -> dict:
    load = os.getloadavg()[0]
    result = run()
    print(
        f"  {name}: {result['tokens_per_s']:,.0f} tokens/s, {result['tokens_per_cpu_s']:,.0f} tokens/CPU-s "
        f"(load average {load:.1f})",
        flush=True,
    )
    return {**result, "load": load}


def benchmark_shape(label: str, config_path: str, overrides: list[str], args) -> None:
    cfg = load_config([config_path, *overrides])
    B, K, T = cfg.train.micro_batch_size, cfg.train.grad_accum_steps, cfg.data.seq_len
    print(
        f"\n{label}: {cfg.model.type}, micro-batch {B} x accumulation {K} x {T} tokens = {B * K * T} tokens/step"
    )
    eager_row = "eager (every switch off)"
    singles = {eager_row: OFF, **{f"+ {k}": {**OFF, **v} for k, v in SWITCHES.items()}}
    results: dict[str, list[dict]] = {name: [] for name in [*singles, "best", "lean reference"]}
    lean_cmd = [
        sys.executable,
        __file__,
        config_path,
        "--lean",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
    ]

    def run_recipe(switches):
        return lambda: recipe(config_path, [*overrides, *args.recipe_args], switches, args.steps, args.warmup)

    def run_lean():
        out = subprocess.run([*lean_cmd, *overrides], check=True, capture_output=True, text=True).stdout
        return json.loads(out.splitlines()[-1])

    def median(name, key="tokens_per_s"):
        values = [r[key] for r in results[name] if r.get(key) is not None]
        return statistics.median(values) if values else None

    def rounds(runs: dict) -> list[dict]:
        """Every run once per round, odd rounds in reverse order (a load that drifts cancels out)."""
        measured = []
        for round_ in range(args.rounds):
            print(f" round {round_ + 1}: {', '.join(runs)}", flush=True)
            names = list(runs) if round_ % 2 == 0 else list(reversed(runs))
            measured.append({name: measure(name, runs[name]) for name in names})
            for name in names:
                results[name].append(measured[-1][name])
        return measured

    best = dict(OFF)
    if args.best is None:
        rounds({name: run_recipe(switches) for name, switches in singles.items()})
        # The best combination: every switch faster alone than eager, except activation checkpointing
        # (it buys memory with compute). Then eager, best and the lean reference side by side.
        for switch, values in SWITCHES.items():
            if switch != "activation checkpointing" and median(f"+ {switch}") > median(eager_row):
                best.update(values)
    else:  # given: the single-switch rounds are skipped
        for switch in filter(None, args.best.split(",")):
            best.update(SWITCHES[switch.strip()])
        results = {name: results[name] for name in (eager_row, "best", "lean reference")}
    paired = rounds({eager_row: run_recipe(OFF), "best": run_recipe(best), "lean reference": run_lean})

    eager = median(eager_row)
    on = [k for k, v in SWITCHES.items() if all(best[f] == x for f, x in v.items())]
    loads = [r["load"] for v in results.values() for r in v]
    print(
        f"best combination: {' + '.join(on) or 'none'}; load average {min(loads):.1f}-{max(loads):.1f} (2 cores)"
    )
    print(
        f"{'':32} {'tokens/s: median (spread)':>28} {'x eager':>8} {'tokens/CPU-s':>13} {'x eager':>8} "
        f"{'peak RSS':>9} {'compile':>8}"
    )
    for name in results:
        values = [r["tokens_per_s"] for r in results[name]]
        compile_s = median(name, "compile_s")
        cpu = median(name, "tokens_per_cpu_s")
        print(
            f"{name:32} {median(name):>10,.0f} ({min(values):,.0f}-{max(values):,.0f}) "
            f"{median(name) / eager:>7.2f}x {cpu:>13,.0f} {cpu / median(eager_row, 'tokens_per_cpu_s'):>7.2f}x "
            f"{median(name, 'peak_rss_bytes') / 2**30:>7.2f}G {f'{compile_s:.0f} s' if compile_s else '-':>8}"
        )
    lean_info = results["lean reference"][0]
    for label_, over in (
        ("best / eager", eager_row),
        ("recipe (best) / lean reference", "lean reference"),
        ("recipe (eager) / lean reference", "lean reference"),
    ):
        for clock, key in (("wall", "tokens_per_s"), ("CPU", "tokens_per_cpu_s")):
            mine = eager_row if label_.startswith("recipe (eager)") else "best"
            ratios = [r[mine][key] / r[over][key] for r in paired]
            print(
                f"{label_}, {clock} clock = {statistics.median(ratios):.2f}x (side by side, per round: "
                f"{', '.join(f'{x:.2f}x' for x in ratios)})"
            )
    print(f"lean model: {lean_info['params']:,} parameters, {lean_info['threads']} threads")
    # Evaluation runs without autograd: the chunked loss then skips its gradient matmuls.
    full, chunked = (eval_seconds(config_path, overrides, impl) for impl in ("full", "chunked"))
    print(
        f"evaluation ({cfg.eval.batches} x {cfg.eval.batch_size} blocks, fastest of 3): full loss {full:.2f} s, "
        f"chunked loss {chunked:.2f} s ({chunked / full:.2f}x)"
    )
    if args.to_target:
        step_ratio = {  # a step's time relative to the lean reference's, from the side-by-side rounds
            (name, clock): statistics.median(r["lean reference"][key] / r[name][key] for r in paired)
            for name in (eager_row, "best")
            for clock, key in (("wall", "tokens_per_s"), ("CPU", "tokens_per_cpu_s"))
        }
        time_to_target(config_path, overrides, best, step_ratio, B * K * T, args)


def time_to_target(config_path: str, overrides: list[str], best: dict, step_ratio: dict, tokens: int, args):
    """The lean reference's held-out loss after `args.to_target` steps is the target; the recipe (best
    switches) trains the same steps, schedule and tokens per step, evaluated every tenth of them; the
    first evaluation at or below the target gives its steps to the target. Its time to the target is
    those steps at its step time relative to the lean reference's (side by side, above): the two
    trainings themselves run one after the other, so their own seconds are only shown."""
    n = args.to_target
    every = max(1, n // 10)
    over = [*overrides, f"--train.max_steps={n}"]
    print(
        f" time to target: lean reference and recipe (best{', ' + ' '.join(args.recipe_args) if args.recipe_args else ''}), "
        f"{n} steps of {tokens} tokens, evaluated every {every}"
    )
    lean_cmd = [
        sys.executable,
        __file__,
        config_path,
        "--lean",
        f"--steps={n}",
        "--warmup=0",
        f"--eval-every={every}",
    ]
    lean_run = json.loads(
        subprocess.run([*lean_cmd, *over], check=True, capture_output=True, text=True).stdout.splitlines()[-1]
    )
    lean_curve = {int(k): v for k, v in lean_run["eval_loss"].items()}
    target = lean_curve[n]
    ours = recipe(config_path, [*over, *args.recipe_args], best, n, 0, eval_every=every)
    reached = [step for step, loss in sorted(ours["eval_loss"].items()) if step and loss <= target]
    print(f"{'step':>6} {'lean reference':>15} {'recipe (best)':>14}")
    for step in sorted(ours["eval_loss"]):
        lean_loss = f"{lean_curve[step]:.4f}" if step in lean_curve else "-"
        print(f"{step:>6} {lean_loss:>15} {ours['eval_loss'][step]:>14.4f}")
    print(
        f"target: held-out loss {target:.4f} (the lean reference's after {n} steps); trainings' own seconds "
        f"(one after the other, not side by side): lean {lean_run['train_s']:.1f} s, recipe {ours['train_s']:.1f} s"
    )
    if not reached:
        print(
            f"recipe: target NOT reached in {n} steps (final {ours['eval_loss'][n]:.4f}, "
            f"{ours['eval_loss'][n] - target:+.4f} nats)"
        )
        return
    steps = reached[0]
    for (name, clock), ratio in step_ratio.items():
        print(
            f"recipe {name}: {steps} steps to the target = {steps / n:.2f}x the steps; step time ({clock} clock) "
            f"{ratio:.2f}x the lean reference's (side by side); time to the target = {steps / n * ratio:.2f}x"
        )


def gpt2_shape(config_path: str, folder: Path, tokenizer: str | None = None, vocab: int | None = None) -> str:
    """The config with its model swapped for the GPT-2 shape (same data; its tokenizer and vocabulary
    unless given)."""
    data = yaml.safe_load(Path(config_path).read_text())
    vocab = vocab or data["model"].get("overrides", {}).get("vocab_size")
    data["model"] = {"type": "gpt2", "overrides": {**GPT2, **({"vocab_size": vocab} if vocab else {})}}
    data["data"]["seq_len"] = 64
    if tokenizer:
        data["data"]["tokenizer"] = tokenizer
    data["train"].update(micro_batch_size=12, grad_accum_steps=1)
    path = folder / f"gpt2-4x128-v{vocab}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed first steps (compilation happens there)"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--shapes", default="config,gpt2,chars", help="any of config, gpt2, chars (comma-separated)"
    )
    parser.add_argument(
        "--best",
        help="the best combination, e.g. 'sdpa attention,fused AdamW' ('' = none): skips the single-switch rounds",
    )
    parser.add_argument(
        "--to-target",
        type=int,
        default=0,
        help="also wall time to the lean reference's held-out loss after this many steps (0: off)",
    )
    parser.add_argument(
        "--recipe-args",
        type=str.split,
        default=[],
        help="overrides for the recipe's runs only, e.g. '--optim.name=muon --optim.lr=1.6e-2' (the lean "
        "reference keeps AdamW at the config's settings)",
    )
    parser.add_argument("--eval-every", type=int, default=0, help=argparse.SUPPRESS)  # lean runs only
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="threads per run (0: every core); 1 stays meaningful on a busy machine",
    )
    parser.add_argument("--lean", action="store_true", help=argparse.SUPPRESS)  # one lean run, JSON out
    parser.add_argument("--recipe", action="store_true", help=argparse.SUPPRESS)  # the recipe, CPU clock on
    if sys.argv[1:2] == ["--recipe"]:  # launched by accelerate: every other argument is the recipe's
        run_recipe_with_cpu_clock(sys.argv[2:])
        return
    args, overrides = parser.parse_known_args()
    if args.lean:  # the overrides already carry the parent's --run.threads
        print(json.dumps(lean(args.config, overrides, args.steps, args.warmup, args.eval_every)))
        return
    overrides = [*overrides, f"--run.threads={args.threads}"]
    with tempfile.TemporaryDirectory() as tmp:
        shapes = {"config": (Path(args.config).name, args.config)}
        shapes["gpt2"] = ("GPT-2 4 layers x 4 heads x 128 wide", gpt2_shape(args.config, Path(tmp)))
        chars = gpt2_shape(args.config, Path(tmp), CHARS, len(load_tokenizer(CHARS)))
        shapes["chars"] = ("GPT-2 4 x 4 x 128, character-level vocabulary", chars)
        for key in args.shapes.split(","):
            benchmark_shape(*shapes[key], overrides, args)


if __name__ == "__main__":
    main()
