#!/bin/bash
# Run by the sbatch scripts here after the launcher returns: requeue the job if train.py stopped on a preemption.
#   bash scripts/slurm/requeue_if_preempted.sh OUTPUT_DIR [LAUNCHER_STATUS]
# The launcher's exit code cannot tell: train.py exits 75 after saving its preemption checkpoint, but
# `accelerate launch` and `torchrun` report any failed worker as 1. The run directory can:
#   1. OUTPUT_DIR/model/model.safetensors exists: training finished.                  -> exit LAUNCHER_STATUS
#   2. the newest checkpoint, OUTPUT_DIR/checkpoints/step_<N> with the largest N, has "preempted": true in its
#      trainer_state.json:                                 -> scontrol requeue $SLURM_JOB_ID, exit 0
#      (the requeued job runs the same command; --resume_from_checkpoint latest continues from that checkpoint)
#   3. anything else (an error, or killed before the checkpoint was complete)          -> exit LAUNCHER_STATUS
# If LAUNCH_START (epoch seconds, set by the sbatch scripts just before the launch) is set, rule 2 also requires the
# checkpoint to be written after it: a resumed run that fails before its next checkpoint leaves the previous job's
# preempted checkpoint newest, and must fail instead of being requeued forever.
set -euo pipefail

output_dir="${1:?usage: requeue_if_preempted.sh OUTPUT_DIR [LAUNCHER_STATUS]}"
status="${2:-0}"
say() { echo "requeue_if_preempted: $*" >&2; }

newest_checkpoint() {  # the complete step_<N> folder (it has a trainer_state.json) with the largest N, numerically
    local dir step newest="" newest_step=-1
    for dir in "$output_dir"/checkpoints/step_*; do
        step="${dir##*/step_}"
        [[ "$step" =~ ^[0-9]+$ && -f "$dir/trainer_state.json" ]] || continue
        if ((10#$step > newest_step)); then
            newest="$dir"
            newest_step=$((10#$step))
        fi
    done
    echo "$newest"
}

mtime() { stat -c %Y "$1" 2>/dev/null || stat -f %m "$1"; }  # GNU, then BSD stat

if [[ -f "$output_dir/model/model.safetensors" ]]; then
    say "$output_dir/model/model.safetensors exists: training finished"
    exit "$status"
fi
checkpoint="$(newest_checkpoint)"
state="$checkpoint/trainer_state.json"
if [[ -n "$checkpoint" ]] && grep -Eq '"preempted"[[:space:]]*:[[:space:]]*true' "$state"; then
    if [[ -n "${LAUNCH_START:-}" ]] && (($(mtime "$state") < LAUNCH_START)); then
        say "$checkpoint was saved on preemption before this launch, and this run saved none: not requeueing"
        exit "$status"
    fi
    say "$checkpoint was saved on preemption: requeueing job ${SLURM_JOB_ID:?SLURM_JOB_ID is not set}"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$status"
