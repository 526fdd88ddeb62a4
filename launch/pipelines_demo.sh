#!/usr/bin/env bash
# The after-the-climb pipelines end to end on the tiny CPU model (issue D1, README "Pipelines"):
#
#   launch/pipelines_demo.sh [OUT]        # default OUT=runs/d1
#   PIPELINES=long2short launch/pipelines_demo.sh [OUT]   # one of the two (default: both)
#
# Measured on the shared 2-core CPU: consolidation 26 minutes (base 80 s, specialists 328 + 370 s,
# consolidation 747 s; load average 15-20 from other work), long2short 17 minutes (long model
# 109 s, one-pass fine-tune 37 s, merge 4 s, sampling 55 s, rejection SFT 78 s, DPO 59 s, RL
# 637 s, comparison 16 s).
#
# Consolidation: a tiny base, an addition and a subtraction specialist climbed from it, and their
# consolidation (SFT on both climbs' successful rollouts, then one climb over the union) ->
# OUT/consolidated/report.md. long2short: an overthinking model (long2short_base_tiny.gin: the
# working, then the same working again), then the four shortening methods from it (merging with
# a one-pass fine-tune of it, shortest rejection sampling + SFT, DPO on its own samples, RL with
# the Kimi length reward) compared on the held-out split -> OUT/long2short/long2short.json. A step whose output is complete is skipped, so a
# rerun picks up where a stopped one left off.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-runs/d1}
PY=${PYTHON:-.venv/bin/python}
PIPELINES=${PIPELINES:-consolidation,long2short}
mkdir -p "$OUT"

# step NAME MARKER CMD...: run CMD (its output also in OUT/NAME.log) unless MARKER exists.
step() {
  local name=$1 marker=$2
  shift 2
  if [[ -e "$marker" ]]; then
    echo "== $name: done already ($marker)"
    return
  fi
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > >(tee "$OUT/$name.log") 2>&1
  echo "== $name: $((SECONDS - t0)) s"
}

# --- Consolidation -------------------------------------------------------------------------------
# Held out: 2-digit problems only (ArithmeticSuite.heldout_min_digits). Held-out one-digit facts
# are facts a specialist's climb never rehearses, so their pass@1 measures forgetting of the
# base's pre-training, not arithmetic (measured: an addition specialist held out on the default
# split fell 0.355 -> 0.29 in 5 minutes: one-digit facts 0.52 -> 0.35, 2-digit + 1-digit 0.40 ->
# 0.53, 2-digit + 2-digit 0.05 -> 0.00).
HELDOUT="ArithmeticSuite.heldout_min_digits = 2"
if [[ $PIPELINES == *consolidation* ]]; then
step base "$OUT/base/summary.txt" \
  "$PY" -m hcjax.sft --output_dir "$OUT/base" --log_format json
for kind in add sub; do
  step "spec_$kind" "$OUT/spec_$kind/summary.json" \
    "$PY" -m hcjax.climb --base_checkpoint "$OUT/base" --log_format json \
      --gin_param "ArithmeticSuite.kinds = ('$kind',)" --gin_param "$HELDOUT" \
      --gin_param "ClimbConfig.max_minutes = 5" --output_dir "$OUT/spec_$kind"
done
step consolidate "$OUT/consolidated/report.json" \
  "$PY" -m hcjax.consolidate --gin_file consolidate_tiny.gin --base_checkpoint "$OUT/base" \
    --climb "$OUT/spec_add" --climb "$OUT/spec_sub" --gin_param "$HELDOUT" \
    --output_dir "$OUT/consolidated"
fi

# --- long2short ----------------------------------------------------------------------------------
if [[ $PIPELINES == *long2short* ]]; then
step long "$OUT/long/summary.txt" \
  "$PY" -m hcjax.sft --gin_file long2short_base_tiny.gin --output_dir "$OUT/long" \
    --log_format json
# Merging: the long model averaged with a short fine-tune of it (same init).
step l2s_short "$OUT/l2s_short/summary.txt" \
  "$PY" -m hcjax.sft --gin_file long2short_short_tiny.gin --output_dir "$OUT/l2s_short" \
    --gin_param "TrainerConfig.init_checkpoint = '$OUT/long'" --log_format json
step l2s_merge "$OUT/l2s_merge/checkpoints" \
  "$PY" -m hcjax.merge --checkpoint "$OUT/long" --checkpoint "$OUT/l2s_short" \
    --weights 0.5,0.5 --output_dir "$OUT/l2s_merge"
# Shortest rejection sampling: k = 8 samples per training problem, the shortest correct kept.
step l2s_samples "$OUT/l2s_samples/rejection.json" \
  "$PY" -m hcjax.rejection --gin_file long2short_base_tiny.gin --checkpoint "$OUT/long" \
    --k 8 --num_problems 512 --output_dir "$OUT/l2s_samples"
step l2s_rejection "$OUT/l2s_rejection/summary.txt" \
  "$PY" -m hcjax.sft --gin_file long2short_rejection_tiny.gin --output_dir "$OUT/l2s_rejection" \
    --gin_param "DataConfig.path = '$OUT/l2s_samples/rejection.jsonl'" \
    --gin_param "TrainerConfig.init_checkpoint = '$OUT/long'" --log_format json
# DPO on the same samples: shortest correct chosen, >= 1.5x longer correct or wrong rejected.
step l2s_dpo "$OUT/l2s_dpo/summary.json" \
  "$PY" -m hcjax.dpo --gin_file long2short_dpo_tiny.gin \
    --samples "$OUT/l2s_samples/samples.jsonl" --init_checkpoint "$OUT/long" \
    --output_dir "$OUT/l2s_dpo"
# RL with the Kimi length reward.
step l2s_rl "$OUT/l2s_rl/summary.json" \
  "$PY" -m hcjax.climb --gin_file long2short_tiny.gin --base_checkpoint "$OUT/long" \
    --log_format json --output_dir "$OUT/l2s_rl"
step long2short "$OUT/long2short/long2short.json" \
  "$PY" -m hcjax.long2short --gin_file long2short_base_tiny.gin --output_dir "$OUT/long2short" \
    --checkpoint "long=$OUT/long" --checkpoint "merge=$OUT/l2s_merge" \
    --checkpoint "rejection=$OUT/l2s_rejection" --checkpoint "dpo=$OUT/l2s_dpo" \
    --checkpoint "rl=$OUT/l2s_rl"
fi

echo
echo "consolidation: $OUT/consolidated/report.md"
echo "long2short:    $OUT/long2short/long2short.json (one line per model in $OUT/long2short.log)"
