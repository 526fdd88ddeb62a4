#!/usr/bin/env bash
# Multi-process climb on one machine (127.0.0.1): K inference processes (python -m hcjax.serve,
# each a rollout server with gRPC Rollout + Weights services) and one learner / controller process
# (python -m hcjax.climb) that reaches them through the router and pushes weights to them.
#
#   launch/local.sh [--dry_run] [--num_inference K] [--base_port P] [--devices_per_process D]
#                   [--output_dir DIR] [-- extra flags, e.g. --gin_param ...]
#
# Extra flags all go to the learner; the gin ones (--gin_file, --gin_param) go to the inference
# processes too, so that they build the learner's model. Engine sizes of each inference process:
# $MAX_PREFILL_LENGTH (default 32), $MAX_CONCURRENT_DECODES (default 128) and, when set,
# $MAX_TARGET_LENGTH (default: the model's max_seq_len).
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
NUM_INFERENCE=1
BASE_PORT=50151
DEVICES=1
OUTPUT_DIR=runs/climb_local
PY=${PYTHON:-.venv/bin/python}
MAX_PREFILL_LENGTH=${MAX_PREFILL_LENGTH:-32}
MAX_CONCURRENT_DECODES=${MAX_CONCURRENT_DECODES:-128}
MAX_TARGET_LENGTH=${MAX_TARGET_LENGTH:-}
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry_run) DRY_RUN=1; shift ;;
    --num_inference) NUM_INFERENCE="$2"; shift 2 ;;
    --base_port) BASE_PORT="$2"; shift 2 ;;
    --devices_per_process) DEVICES="$2"; shift 2 ;;
    --output_dir) OUTPUT_DIR="$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "local.sh: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done
if ! [[ "$NUM_INFERENCE" =~ ^[1-9][0-9]*$ ]]; then
  echo "local.sh: --num_inference=$NUM_INFERENCE must be a positive integer" >&2; exit 2
fi

EXTRA_Q=""
if (( ${#EXTRA[@]} )); then EXTRA_Q=$(printf ' %q' "${EXTRA[@]}"); fi
# The gin flags among EXTRA, for the inference processes; without a --gin_file, the climb's
# default (hcjax.climb's climb_tiny.gin) rather than hcjax.serve's.
GIN_Q=""
GIN_FILE=" --gin_file climb_tiny.gin"
for ((j = 0; j < ${#EXTRA[@]}; j++)); do
  case "${EXTRA[$j]}" in
    --gin_file | --gin_file=*) GIN_FILE="" ;;&
    --gin_file | --gin_param) GIN_Q+=$(printf ' %q %q' "${EXTRA[$j]}" "${EXTRA[$((j + 1))]:-}"); ((++j)) ;;
    --gin_file=* | --gin_param=*) GIN_Q+=$(printf ' %q' "${EXTRA[$j]}") ;;
  esac
done
GIN_Q="$GIN_FILE$GIN_Q"
SIZES="--max_prefill_length $MAX_PREFILL_LENGTH --max_concurrent_decodes $MAX_CONCURRENT_DECODES"
if [[ -n "$MAX_TARGET_LENGTH" ]]; then SIZES+=" --max_target_length $MAX_TARGET_LENGTH"; fi
ENV="XLA_FLAGS=--xla_force_host_platform_device_count=$DEVICES JAX_PLATFORMS=cpu"
ADDRESSES=()
COMMANDS=()
for ((i = 0; i < NUM_INFERENCE; i++)); do
  PORT=$((BASE_PORT + i))
  ADDRESSES+=("--inference_address" "127.0.0.1:$PORT")
  COMMANDS+=("env $ENV $PY -m hcjax.serve --host 127.0.0.1 --port $PORT $SIZES$GIN_Q")
done
LEARNER="env $ENV $PY -m hcjax.climb --output_dir $OUTPUT_DIR ${ADDRESSES[*]}$EXTRA_Q"

if [[ $DRY_RUN == 1 ]]; then
  for c in "${COMMANDS[@]}"; do echo "inference: $c"; done
  echo "learner: $LEARNER"
  exit 0
fi

mkdir -p "$OUTPUT_DIR"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
for ((i = 0; i < NUM_INFERENCE; i++)); do
  LOG="$OUTPUT_DIR/inference_$i.log"
  bash -c "exec ${COMMANDS[$i]}" >"$LOG" 2>&1 &
  PIDS+=("$!")
done
for ((i = 0; i < NUM_INFERENCE; i++)); do  # wait for each server's readiness line
  LOG="$OUTPUT_DIR/inference_$i.log"
  for _ in $(seq 1 600); do
    grep -q '"event": "serving"' "$LOG" 2>/dev/null && break
    kill -0 "${PIDS[$i]}" 2>/dev/null || { echo "inference $i died:" >&2; tail "$LOG" >&2; exit 1; }
    sleep 1
  done
done
bash -c "exec $LEARNER"
