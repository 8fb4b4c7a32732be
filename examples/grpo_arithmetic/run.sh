#!/usr/bin/env bash
# SFT warm start on the shipped arithmetic answers, then GRPO on the shipped arithmetic
# prompts from that checkpoint; prints the GRPO curve from metrics.jsonl at the end.
#
#   examples/grpo_arithmetic/run.sh [OUT_DIR] [--lora]
#
# OUT_DIR (default runs/grpo_arithmetic) gets sft/ and grpo/ (grpo_lora/ with --lora).
# An existing sft/checkpoints/step-250 is reused (delete OUT_DIR/sft to redo it).
# Threads: OMP_NUM_THREADS (default 2, the 2-core machine the README's numbers come from).
set -euo pipefail

DEFAULT_OUT=runs/grpo_arithmetic
# shellcheck source=../grpo_common.sh
source "$(dirname "$0")/../grpo_common.sh"  # OUT, LORA, PY, RUN, ASSETS, MODEL
SFT_STEPS=250

# 1. SFT: the 400 answered questions (ChatML, the shipped chat tokenizer), packed 64 tokens a row.
if [ ! -f "$OUT/sft/checkpoints/step-$SFT_STEPS/manifest.json" ]; then
    rm -rf "$OUT/sft"
    SECONDS=0
    "$RUN" "${MODEL[@]}" data=chat data.path="$ASSETS/arithmetic_sft.jsonl" \
        training.seq_len=64 training.local_batch_size=32 training.steps=$SFT_STEPS \
        training.lr=5e-3 training.warmup_steps=10 checkpoint.enabled=true \
        checkpoint.interval=$SFT_STEPS hydra.run.dir="$OUT/sft"
    echo "sft wall: ${SECONDS}s"
fi

# 2. GRPO on the 400 shipped prompts (data=prompts without data.path), from the SFT weights.
GRPO=(objective=grpo data=prompts checkpoint.init_from="$OUT/sft/checkpoints/step-$SFT_STEPS"
      objective.num_generations=8 objective.max_completion_length=4 training.seq_len=24
      training.local_batch_size=16 training.steps=30 training.warmup_steps=0)
grpo_stage 5e-4 5e-3 "${GRPO[@]}"  # then its curve
