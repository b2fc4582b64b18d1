#!/usr/bin/env bash
# The checks that need a GPU, in one short run (about 5 minutes on one H100/H200, at most TOTAL_S seconds): prints a
# version line and one markdown table row per check for the table in docs/launching.md ("What has run where"); each
# run's files and log stay in $OUT. A check that fails, or runs out of time, prints a FAILED row and the next one
# runs. CPU-only CI never runs this; tests skip GPU paths cleanly.
#   bash scripts/gpu_check.sh       # OUT=runs/gpu_check, TOTAL_S=500, LM_STEPS=100 (compiled), LM_EAGER_STEPS=60
#   LM_ARGS="--per_device_train_batch_size 64" bash scripts/gpu_check.sh   # extra flags for both LM runs
# The LM rows report the median train/tokens_per_s and train/mfu over the logging windows after the first: each
# window's numbers are its own steps' (the timer restarts at every log line), so the first window, which holds
# torch.compile's warm-up, is left out and reported on its own.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-$(command -v python || command -v python3)}
TOTAL_S=${TOTAL_S:-500}  # the whole script's budget: a check gets what is left of it, at most its own limit
LM_STEPS=${LM_STEPS:-100}
read -r -a LM_ARGS <<< "${LM_ARGS:-}"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} PYTHONUNBUFFERED=1  # everything here is local: never wait on the network
LAUNCH=("$PY" -m accelerate.commands.launch)
SINGLE=("${LAUNCH[@]}" --config_file accelerate_configs/single_gpu.yaml train.py)
FSDP=("${LAUNCH[@]}" --config_file accelerate_configs/fsdp.yaml --num_processes 1 train.py)
# the GPU LM, sized to finish fast: a small eval of whole batches (a ragged last batch would compile another graph)
LM=("${SINGLE[@]}" --config configs/lm_gpu.yaml --max_steps "$LM_STEPS" --logging_steps 20 --max_eval_samples 256
    --save_steps 0 "${LM_ARGS[@]}")

summary() {  # summary DIR LOG NAME: a run's metrics.jsonl (and log) in a few words
    "$PY" - "$@" <<'PY'
import json, re, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl")]
log, name = open(sys.argv[2]).read(), sys.argv[3]
train = [r for r in rows if "train/loss" in r]
evals = [r for r in rows if "eval/loss" in r][-1]
parts = [f"step {evals['step']}", f"eval loss {evals['eval/loss']:.4f}"]
parts += [f"{k.split('/')[1]} {v:.4f}" for k, v in evals.items() if k in ("eval/accuracy", "eval/perplexity")]
parts += [f"{train[-1]['train/samples_per_s']:.0f} samples/s (last window)"]
if "train/tokens_per_s" in train[-1]:
    steady = train[1:] or train
    first = train[0]
    parts += [f"{statistics.median(r['train/tokens_per_s'] for r in steady):.0f} tokens/s"]
    if "train/mfu" in first:
        parts += [f"MFU {100 * statistics.median(r['train/mfu'] for r in steady):.1f}%"]
    parts += [f"median of {len(steady)} windows after step {first['step']}",
              f"first window {first['train/step_time_s'] * first['step']:.0f} s (warm-up)"]
parts += [f"peak {max(r['train/peak_memory_gb'] for r in train):.2f} GB"]
halved = re.findall(r"retrying with (\d+)", log)
parts += [f"per-device batch halved to {halved[-1]}" if halved else "no halving"] if name.startswith("auto") else []
resumed = re.search(r"resuming from \S+ at step (\d+)", log)
parts += [f"resumed from step {resumed.group(1)}"] if resumed else []
print(", ".join(parts))
PY
}

check() {  # check NAME DIR COMMAND...: run COMMAND --output_dir DIR under a time limit, print a table row
    local name=$1 dir=$2 limit=$3; shift 3
    local left=$((TOTAL_S - SECONDS))
    ((limit > left)) && limit=$left
    if ((limit < 30)); then
        echo "| $name | FAILED: skipped, the script's ${TOTAL_S} s budget is spent | | |"
        return
    fi
    local start=$SECONDS
    if timeout -k 10 "$limit" "$@" --output_dir "$dir" > "$OUT/$name.log" 2>&1; then
        echo "| $name | ok | $((SECONDS - start)) s | $(summary "$dir" "$OUT/$name.log" "$name" 2>&1 | tail -n 1) |"
    else
        local rc=$?
        local why="timed out after $limit s"  # else train.py's one-line error, a traceback's last error, the last line
        ((rc == 124 || rc == 137)) || why=$( (grep -m 1 "^error: " "$OUT/$name.log" \
            || grep -E "(Error|Exception)\b" "$OUT/$name.log" | tail -n 1 || tail -n 1 "$OUT/$name.log") | cut -c1-150)
        echo "| $name | FAILED: $why | $((SECONDS - start)) s | see $OUT/$name.log |"
    fi
}

"$PY" -c "
import platform, torch, accelerate
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'
print(f'GPU: {name} | torch {torch.__version__} (CUDA {torch.version.cuda}) | accelerate {accelerate.__version__} | Python {platform.python_version()}')
" || echo "torch cannot see a GPU here"
echo "| check | result | wall time | numbers |"
echo "| --- | --- | --- | --- |"
[ -f data/stdlib/train.parquet ] || timeout 120 "$PY" scripts/prepare_text.py > "$OUT/prepare_text.log" 2>&1 \
    || echo "| prepare_text | FAILED: $(tail -n 1 "$OUT/prepare_text.log" | cut -c1-150) | | |"
# the GPU LM first: the MFU figure is this script's main number
check lm_gpu_bf16_compiled "$OUT/lm_gpu_compiled" 300 "${LM[@]}" --torch_compile true --overwrite_output_dir true
check digits_bf16 "$OUT/digits_bf16" 120 "${SINGLE[@]}" --overwrite_output_dir true
check fsdp2_1_process "$OUT/fsdp2_1_process" 120 "${FSDP[@]}" --overwrite_output_dir true
check fsdp2_1_process_resumed "$OUT/fsdp2_1_process" 90 "${FSDP[@]}" --max_steps 240 --resume_from_checkpoint latest
if "$PY" -c "import deepspeed, transformers" 2>/dev/null; then
    check deepspeed_zero2_1_process "$OUT/deepspeed_zero2" 120 "${LAUNCH[@]}" \
        --config_file accelerate_configs/deepspeed_zero2.yaml --num_processes 1 train.py --overwrite_output_dir true
    check deepspeed_zero3_1_process "$OUT/deepspeed_zero3" 120 "${LAUNCH[@]}" \
        --config_file accelerate_configs/deepspeed_zero3.yaml --num_processes 1 train.py --overwrite_output_dir true
    check deepspeed_zero3_1_process_resumed "$OUT/deepspeed_zero3" 90 "${LAUNCH[@]}" \
        --config_file accelerate_configs/deepspeed_zero3.yaml --num_processes 1 train.py --max_steps 240 \
        --resume_from_checkpoint latest
else
    echo "| deepspeed | skipped: pip install -r requirements/deepspeed.txt | | |"
fi
# auto batch size under a forced memory cap: the per-device batch halves, the global batch stays
check auto_batch_size_capped "$OUT/auto_batch_size_capped" 120 "$PY" -c "
import sys, torch
torch.cuda.set_per_process_memory_fraction(0.002)  # ~280 MB of an H200
from src.errors import command_line
from train import main
command_line(main)(sys.argv[1:])" --task causal_lm --config configs/lm.yaml --per_device_train_batch_size 64 \
    --global_batch_size 64 --auto_find_batch_size true --max_steps 20 --overwrite_output_dir true
# the same LM without torch.compile, for comparison (last: the first check to give up when time is short)
check lm_gpu_bf16_eager "$OUT/lm_gpu_eager" 150 "${LM[@]}" --max_steps "${LM_EAGER_STEPS:-60}" --torch_compile false \
    --overwrite_output_dir true
echo "total: $SECONDS s"
