#!/usr/bin/env bash
# The checks that need a GPU, in one short run (about 5 minutes on one H100/H200): prints one markdown table row per
# check for the README's compatibility table. CPU-only CI never runs this; tests skip GPU paths cleanly.
#   bash scripts/gpu_check.sh            # OUT=runs/gpu_check by default
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python}
LAUNCH=("$PY" -m accelerate.commands.launch)

summary() {  # the last train and eval lines of a run's metrics.jsonl, in a few words
    "$PY" - "$1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
train = [r for r in rows if "train/loss" in r][-1]
evals = [r for r in rows if "eval/loss" in r][-1]
parts = [f"step {evals['step']}", f"eval loss {evals['eval/loss']:.4f}"]
parts += [f"{k.split('/')[1]} {v:.4f}" for k, v in evals.items() if k in ("eval/accuracy", "eval/perplexity")]
parts += [f"{train['train/samples_per_s']:.0f} samples/s", f"peak {train['train/peak_memory_gb']:.2f} GB"]
parts += [f"{train['train/tokens_per_s']:.0f} tokens/s"] if "train/tokens_per_s" in train else []
parts += [f"MFU {100 * train['train/mfu']:.1f}%"] if "train/mfu" in train else []
print(", ".join(parts))
PY
}

check() {  # check NAME COMMAND...: run it, print a table row
    local name=$1; shift
    local start=$SECONDS
    if "$@" --output_dir "$OUT/$name" --overwrite_output_dir true > "$OUT/$name.log" 2>&1; then
        echo "| $name | ok | $((SECONDS - start)) s | $(summary "$OUT/$name") |"
    else
        echo "| $name | FAILED: $(tail -n 1 "$OUT/$name.log" | cut -c1-150) | $((SECONDS - start)) s | see $OUT/$name.log |"
    fi
}

"$PY" -c "import torch; print('GPU:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
echo "| check | result | wall time | numbers |"
echo "| --- | --- | --- | --- |"
check digits_bf16 "${LAUNCH[@]}" --config_file accelerate_configs/single_gpu.yaml train.py
check fsdp_1_process "${LAUNCH[@]}" --config_file accelerate_configs/fsdp.yaml --num_processes 1 train.py
if "$PY" -c "import deepspeed, transformers" 2>/dev/null; then
    check deepspeed_zero2_1_process "${LAUNCH[@]}" --config_file accelerate_configs/deepspeed_zero2.yaml \
        --num_processes 1 train.py
    check deepspeed_zero3_1_process "${LAUNCH[@]}" --config_file accelerate_configs/deepspeed_zero3.yaml \
        --num_processes 1 train.py
else
    echo "| deepspeed | skipped: pip install deepspeed transformers | | |"
fi
# auto batch size under a forced memory cap: the per-device batch halves, the global batch stays
check auto_batch_size_capped "$PY" -c "
import sys, torch
torch.cuda.set_per_process_memory_fraction(0.002)  # ~280 MB of an H200
from src.errors import command_line
from train import main
command_line(main)(sys.argv[1:])" --task causal_lm --config configs/lm.yaml --per_device_train_batch_size 64 \
    --global_batch_size 64 --auto_find_batch_size true --max_steps 20
if [ -f data/stdlib/train.parquet ] || "$PY" scripts/prepare_text.py > "$OUT/prepare_text.log" 2>&1; then
    check lm_gpu_bf16 "${LAUNCH[@]}" --config_file accelerate_configs/single_gpu.yaml train.py \
        --config configs/lm_gpu.yaml --max_steps "${LM_STEPS:-300}"
fi
