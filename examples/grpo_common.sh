# Shared by the GRPO examples' run.sh (sourced, not run): the arguments and paths, the tiny
# model, the GRPO stage and the curve it prints. A script sets DEFAULT_OUT, then sources this
# with its own arguments ("$@"); afterwards OUT, LORA, PY, RUN, ASSETS and MODEL are set.

OUT="$DEFAULT_OUT"
LORA=0
for arg in "$@"; do
    case "$arg" in
        --lora) LORA=1 ;;
        -h|--help) sed -n 2,9p "$0"; exit 0 ;;
        *) OUT="$arg" ;;
    esac
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
RUN="${TITAN_RUN:-$ROOT/.venv/bin/titan-run}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
ASSETS="$("$PY" -c 'from titan_plugins.data.chat_source import ASSETS; print(ASSETS)')"

# A tiny Qwen3 (4 layers, dim 128, ~1M parameters besides the 2048-token embedding).
MODEL=(model=qwen3 model.dim=128 model.n_layers=4 model.n_heads=4 model.n_kv_heads=2
       model.head_dim=32 model.hidden_dim=512)

# grpo_stage FULL_LR LORA_LR GRPO_ARGS...: the GRPO run (full fine-tuning, or peft=lora with
# --lora) into OUT/grpo or OUT/grpo_lora, then its curve from metrics.jsonl.
grpo_stage() {
    local full_lr="$1" lora_lr="$2" name extra
    shift 2
    if [ "$LORA" = 1 ]; then
        name=grpo_lora; extra=(peft=lora training.lr="$lora_lr")
    else
        name=grpo; extra=(training.lr="$full_lr")
    fi
    rm -rf "${OUT:?}/$name"
    SECONDS=0
    "$RUN" "${MODEL[@]}" "$@" "${extra[@]}" hydra.run.dir="$OUT/$name"
    echo "$name wall: ${SECONDS}s"
    "$PY" - "$OUT/$name/metrics.jsonl" <<'PYEOF'
import json, sys
print("| step | reward | reward_std | length | frac_reward_zero_std | step_time_s |")
print("|---|---|---|---|---|---|")
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "reward" not in r:
        continue
    print(f"| {r['step']} | {r['reward']:.3f} | {r['reward_std']:.3f} | {r['completions/mean_length']:.2f} "
          f"| {r.get('frac_reward_zero_std', float('nan')):.2f} | {r.get('step_time_s', float('nan')):.1f} |")
PYEOF
}
