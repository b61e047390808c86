#!/usr/bin/env bash
# One-GPU check of the speed switches (issue 10), about 8 minutes on one H100/H200:
#   1. configs/llama-1b.yaml with its shipped switches (bf16, compile, fused AdamW, sdpa, chunked loss),
#      30 steps: tokens/s and MFU (medians after the compile/warm-up steps), peak memory, compile seconds
#   2. the same, 20 steps each, with each switch flipped: compile off, foreach AdamW, full loss, eager
#      attention, and activation checkpointing on (the one switch the config leaves off)
#   3. kill -9 mid-run, then resume: final weights and every logged number bit-identical to a straight
#      run (CUDA RNG state restored), on the same config cut to 2 layers so it takes seconds
#   4. fp16 with the recipe's loss scaler on CUDA: an initial scale of 2^30 overflows, those steps are
#      skipped and the scale halves until training proceeds
#   5. document masking through flash-attention's varlen path (when flash-attn is installed): packed
#      documents score like the documents alone, on the GPU
# Offline: data and tokenizer are the built-in Python-stdlib corpus (a GPU machine may have no network).
#
#   bash scripts/gpu_check.sh [--dry-run] [OUT_DIR]
#
# --dry-run (CPU, in `make test`): checks that every command's config is valid, runs the first one
# with a tiny model for 3 steps and prints its summary, so the script cannot rot.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
OUT=${1:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$OUT"
PY=${PYTHON:-python}
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
START=$SECONDS

COMMON=(
  --data.train='[{name: python-stdlib, split: train}]'
  --data.eval='[{name: python-stdlib, split: validation}]'
  --data.tokenizer=builtin:python-stdlib
  --data.num_workers=2 --data.num_streams=8
  --train.grad_accum_steps=1 --optim.warmup_steps=5
  --eval.every=0 --eval.batches=1 --eval.sample_tokens=0
  --checkpoint.every=0 --logging.wandb_mode=disabled --logging.every=10
)
SMALL=(--model.overrides.num_hidden_layers=2)  # checks 3-4: the mechanism, not the size
if ((DRY)); then
  # CPU stand-ins: a tiny model, no bf16 (slow on CPU), no compile (longer than the run), one thread.
  COMMON+=(
    --model.overrides.hidden_size=64 --model.overrides.intermediate_size=128
    --model.overrides.num_hidden_layers=2 --model.overrides.num_attention_heads=4
    --model.overrides.num_key_value_heads=2 --model.overrides.max_position_embeddings=64
    --data.seq_len=64 --train.micro_batch_size=2 --train.precision='"no"' --run.threads=1
    --train.loss_chunk_tokens=64 --optim.warmup_steps=1 --train.compile=false
  )
fi

train() {  # train NAME [OVERRIDES...]: one run of configs/llama-1b.yaml into $OUT/NAME
  local name=$1; shift
  echo "gpu_check: [$((SECONDS - START))s] $name: $*"
  "$PY" recipes/pretrain.py configs/llama-1b.yaml --run.output_dir="$OUT/$name" --run.resume=never --run.overwrite=true \
    "${COMMON[@]}" "$@" >"$OUT/$name.log" 2>&1 || { tail -20 "$OUT/$name.log"; return 1; }
}

summary() {  # summary NAME: medians after the first 5 steps (compile and warm-up), peak memory
  "$PY" - "$OUT/$1" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl") if '"train/loss"' in line]
timed = rows[5:] or rows
tok = statistics.median(r["perf/tokens_per_s"] for r in timed)
mfu = statistics.median(r["perf/mfu"] for r in timed)
compile_s = next((r["perf/compile_s"] for r in rows if "perf/compile_s" in r), 0.0)
peak = max(r["perf/peak_mem_bytes"] for r in rows) / 2**30
print(f"gpu_check: {sys.argv[1].rsplit('/', 1)[1]:<24} {tok:>10,.0f} tokens/s  MFU {mfu:6.1%}  "
      f"peak {peak:6.1f} GiB  compile {compile_s:5.1f} s  final loss {rows[-1]['train/loss']:.4f}")
EOF
}

# Every variant below, as (name, overrides...); checked for config validity before anything runs.
VARIANTS=(
  "shipped|--train.max_steps=30"
  "compile-off|--train.max_steps=20 --train.compile=false"
  "foreach-adamw|--train.max_steps=20 --optim.fused=false"
  "full-loss|--train.max_steps=20 --train.loss_impl=full"
  "eager-attention|--train.max_steps=20 --model.attn_implementation=eager"
  "activation-checkpointing|--train.max_steps=20 --train.activation_checkpointing=true"
)
"$PY" - "${COMMON[@]}" -- "${VARIANTS[@]}" <<'EOF'
import sys
from lmpretrain.config import config_problems, load_config
cut = sys.argv.index("--")
common, variants = sys.argv[1:cut], sys.argv[cut + 1:]
extra = {"resume": ["--train.max_steps=16", "--checkpoint.every=4"], "fp16": ["--train.precision=fp16"]}
for name, flags in [v.split("|") for v in variants] + [(k, " ".join(v)) for k, v in extra.items()]:
    cfg = load_config(["configs/llama-1b.yaml", *common, *flags.split()])
    if problems := config_problems(cfg, 1):
        sys.exit(f"gpu_check: {name}: {problems}")
print(f"gpu_check: {len(variants) + len(extra)} commands have valid configs")
EOF

if ((DRY)); then
  IFS='|' read -r name flags <<<"${VARIANTS[0]}"
  # shellcheck disable=SC2086
  train "$name" $flags --train.max_steps=3
  summary "$name"
  echo "gpu_check: dry run passed (on a GPU the script also runs the variants, kill -9 + resume, fp16, flash-attention masking)"
  exit 0
fi

"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check: no CUDA device (use --dry-run on a CPU)")'
"$PY" -c 'from lmpretrain.data.tokenizer import ensure_builtin_tokenizer; ensure_builtin_tokenizer()'  # corpus + tokenizer, once

for variant in "${VARIANTS[@]}"; do  # 1-2: tokens/s, MFU, memory with the shipped switches and each flipped
  IFS='|' read -r name flags <<<"$variant"
  # shellcheck disable=SC2086
  train "$name" $flags
  summary "$name"
  rm -rf "${OUT:?}/$name/checkpoints" "${OUT:?}/$name/final"  # ~15 GB each
done

# 3. kill -9 + resume == straight, bit for bit
RESUME=("${SMALL[@]}" --train.max_steps=16 --checkpoint.every=4)
train straight "${RESUME[@]}"
echo "gpu_check: [$((SECONDS - START))s] killed: ${RESUME[*]}"
"$PY" recipes/pretrain.py configs/llama-1b.yaml --run.output_dir="$OUT/killed" --run.resume=never --run.overwrite=true \
  "${COMMON[@]}" "${RESUME[@]}" >"$OUT/killed.log" 2>&1 &
PID=$!
until [[ -f "$OUT/killed/metrics.jsonl" ]] && (($(wc -l <"$OUT/killed/metrics.jsonl") >= 7)); do
  kill -0 $PID 2>/dev/null || { echo "gpu_check: the run ended before it could be killed"; exit 1; }
  sleep 0.2
done
kill -9 $PID; wait $PID || true
"$PY" recipes/pretrain.py configs/llama-1b.yaml --run.output_dir="$OUT/killed" "${COMMON[@]}" "${RESUME[@]}" \
  >"$OUT/resumed.log" 2>&1
"$PY" - "$OUT" <<'EOF'
import hashlib, json, sys
out = sys.argv[1]
def numbers(run):
    keys = ("train/loss", "train/grad_norm", "eval/loss")
    return {r["step"]: [r.get(k) for k in keys] for r in map(json.loads, open(f"{out}/{run}/metrics.jsonl"))}
def digest(run):
    return hashlib.sha256(open(f"{out}/{run}/final/model.safetensors", "rb").read()).hexdigest()
same = numbers("straight") == numbers("killed") and digest("straight") == digest("killed")
print(f"gpu_check: kill -9 + resume on CUDA: {'bit-identical' if same else 'DIFFERENT'} to the straight run")
sys.exit(0 if same else 1)
EOF

# 4. fp16 loss scaling on CUDA
train fp16 "${SMALL[@]}" --train.max_steps=20 --train.precision=fp16 --train.loss_scale_init=1073741824
"$PY" - "$OUT/fp16" <<'EOF'
import json, math, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl") if '"train/loss"' in line]
skipped, scale = rows[-1]["train/skipped_steps"], rows[-1]["train/loss_scale"]
ok = 0 < skipped < len(rows) and scale < 2**30 and math.isfinite(rows[-1]["train/loss"])
print(f"gpu_check: fp16 on CUDA: {skipped} overflow steps skipped, loss scale 2^30 -> {scale:g}, "
      f"final loss {rows[-1]['train/loss']:.4f}: {'ok' if ok else 'WRONG'}")
sys.exit(0 if ok else 1)
EOF

# 5. document masking through flash-attention varlen
"$PY" - <<'EOF'
import importlib.util, torch
from transformers import AutoConfig, AutoModelForCausalLM
from lmpretrain.model.objective import LMObjective, check_objective, install_loss_forward
if importlib.util.find_spec("flash_attn") is None:
    print("gpu_check: flash-attn is not installed: flash-attention document masking not checked")
else:
    config = AutoConfig.for_model("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, use_cache=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
        attn_implementation="flash_attention_2").cuda()
    install_loss_forward(model)
    objective = LMObjective(document_masking=True, eos_token_id=0, single_row=True)
    print("gpu_check:", *check_objective(model, objective, tolerance=2e-2))  # bf16 rounding differs
EOF
echo "gpu_check: passed in $((SECONDS - START)) s; outputs in $OUT"
