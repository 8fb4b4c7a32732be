#!/usr/bin/env bash
# A short SFT warm start on the shipped reverse task, then GRPO on its 400 disjoint prompts
# from that checkpoint; prints the GRPO curve from metrics.jsonl at the end.
#
#   examples/grpo_reverse/run.sh [OUT_DIR] [--lora]
#
# OUT_DIR (default runs/grpo_reverse) gets sft/ and grpo/ (grpo_lora/ with --lora).
# An existing sft/checkpoints/step-$SFT_STEPS is reused (delete OUT_DIR/sft to redo it).
# Threads: OMP_NUM_THREADS (default 2, the 2-core machine the README's numbers come from).
set -euo pipefail

DEFAULT_OUT=runs/grpo_reverse
# shellcheck source=../grpo_common.sh
source "$(dirname "$0")/../grpo_common.sh"  # OUT, LORA, PY, RUN, ASSETS, MODEL
SFT_SCHEDULE=200  # the SFT's lr schedule (warmup 10, cosine over 200 steps) ...
SFT_STEPS=${SFT_STEPS:-105}     # ... and its checkpoint GRPO starts from: deliberately undertrained

# 1. SFT on the 2000 answered reversals (ChatML, the shipped chat tokenizer), packed 64 tokens
#    a row, checkpointed every 5 steps (the 200-step schedule runs to its end, 5 min on a free
#    2-core machine; only step $SFT_STEPS is used). At step $SFT_STEPS the model gets most
#    letters right but rarely all five.
if [ ! -f "$OUT/sft/checkpoints/step-$SFT_STEPS/manifest.json" ]; then
    rm -rf "$OUT/sft"
    SECONDS=0
    "$RUN" "${MODEL[@]}" data=chat data.path="$ASSETS/reverse_sft.jsonl" \
        training.seq_len=64 training.local_batch_size=32 training.steps=$SFT_SCHEDULE \
        training.lr=5e-3 training.warmup_steps=10 checkpoint.enabled=true \
        checkpoint.interval=5 checkpoint.keep_last=40 hydra.run.dir="$OUT/sft"
    echo "sft wall: ${SECONDS}s"
fi

# 2. GRPO on the 400 reverse prompts (never seen by the SFT), from the SFT weights.
GRPO=(objective=grpo data=prompts data.path="$ASSETS/reverse.jsonl"
      checkpoint.init_from="$OUT/sft/checkpoints/step-$SFT_STEPS"
      objective.num_generations=8 objective.max_completion_length=8 training.seq_len=40
      training.local_batch_size=16 training.steps=${GRPO_STEPS:-300} training.warmup_steps=0)
grpo_stage 1e-3 5e-3 "${GRPO[@]}"  # then its curve
