#!/usr/bin/env bash
# Multi-process climb on one machine (127.0.0.1): K inference processes (python -m hcjax.climb
# --role inference, each a rollout server with gRPC Rollout + Weights services) and one learner /
# controller process that reaches them through the router and pushes weights to them.
#
#   launch/local.sh [--dry_run] [--num_inference K] [--base_port P] [--devices_per_process D]
#                   [--output_dir DIR] [-- extra flags for every process, e.g. --gin_param ...]
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
NUM_INFERENCE=1
BASE_PORT=50151
DEVICES=1
OUTPUT_DIR=runs/climb_local
PY=${PYTHON:-.venv/bin/python}
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
ENV="XLA_FLAGS=--xla_force_host_platform_device_count=$DEVICES JAX_PLATFORMS=cpu"
ADDRESSES=()
COMMANDS=()
for ((i = 0; i < NUM_INFERENCE; i++)); do
  PORT=$((BASE_PORT + i))
  ADDRESSES+=("--inference_address" "127.0.0.1:$PORT")
  COMMANDS+=("env $ENV $PY -m hcjax.climb --role inference --host 127.0.0.1 --port $PORT$EXTRA_Q")
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
