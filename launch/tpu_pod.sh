#!/usr/bin/env bash
# Climb on a Cloud TPU pod slice: every host runs its part. Hosts [0, LEARNER_HOSTS) form the
# learner job (python -m hcjax.climb, jax.distributed.initialize with host 0 as coordinator; host 0
# also runs the controller); the other hosts are inference processes (python -m hcjax.serve, gRPC
# Rollout + Weights services) on their own chips.
#
#   launch/tpu_pod.sh --tpu NAME --zone ZONE --num_hosts H [--learner_hosts L] [--port P]
#                     [--dry_run] [-- extra flags]
#
# Extra flags all go to the learner; the gin ones (--gin_file, --gin_param) go to the inference
# processes too, so that they build the learner's model. Engine sizes of each inference process:
# $MAX_PREFILL_LENGTH (default 32), $MAX_CONCURRENT_DECODES (default 128) and, when set,
# $MAX_TARGET_LENGTH (default: the model's max_seq_len).
# The inference processes bind 0.0.0.0, which hcjax.serve refuses without a token:
# $HCJAX_TOKEN_FILE (a path that exists on every host) is passed on to every process, as are
# $HCJAX_TLS_DIR and $HCJAX_TLS_SERVER_NAME when set. The inference processes pull weights only
# from $HCJAX_TRUSTED_PEERS, by default the learner hosts' internal addresses.
set -euo pipefail

DRY_RUN=0
TPU=""
ZONE=""
NUM_HOSTS=""
LEARNER_HOSTS=1
PORT=50151
COORD_PORT=8476
OUTPUT_DIR=runs/climb_pod
REPO=${REPO_DIR:-\$HOME/hcjax}
MAX_PREFILL_LENGTH=${MAX_PREFILL_LENGTH:-32}
MAX_CONCURRENT_DECODES=${MAX_CONCURRENT_DECODES:-128}
MAX_TARGET_LENGTH=${MAX_TARGET_LENGTH:-}
EXTRA=()
EXTRA_Q=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry_run) DRY_RUN=1; shift ;;
    --tpu) TPU="$2"; shift 2 ;;
    --zone) ZONE="$2"; shift 2 ;;
    --num_hosts) NUM_HOSTS="$2"; shift 2 ;;
    --learner_hosts) LEARNER_HOSTS="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --output_dir) OUTPUT_DIR="$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); EXTRA_Q=$(printf ' %q' "$@"); break ;;
    *) echo "tpu_pod.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
for v in TPU ZONE NUM_HOSTS; do
  if [[ -z "${!v}" ]]; then echo "tpu_pod.sh: --${v,,} is required" >&2; exit 2; fi
done
if ! [[ "$NUM_HOSTS" =~ ^[0-9]+$ ]] || (( LEARNER_HOSTS < 1 || LEARNER_HOSTS >= NUM_HOSTS )); then
  echo "tpu_pod.sh: need 1 <= --learner_hosts=$LEARNER_HOSTS < --num_hosts=$NUM_HOSTS" >&2
  exit 2
fi

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

if [[ $DRY_RUN == 0 && -z "${HCJAX_TOKEN_FILE:-}" ]]; then
  echo "tpu_pod.sh: set HCJAX_TOKEN_FILE to a token file present on every host (the inference" \
    "processes serve 0.0.0.0 and refuse to run without a token)" >&2
  exit 2
fi
SECURITY=""  # security settings every process reads from its environment (never the token itself)
for v in HCJAX_TOKEN_FILE HCJAX_TLS_DIR HCJAX_TLS_SERVER_NAME; do
  if [[ -n "${!v:-}" ]]; then SECURITY+="$v=$(printf '%q' "${!v}") "; fi
done

# Internal addresses come from the TPU's description; the coordinator is worker 0.
COORD="\$(gcloud compute tpus tpu-vm describe $TPU --zone $ZONE --format='value(networkEndpoints[0].ipAddress)'):$COORD_PORT"
INFERENCE=()
LEARNER_IPS=()
for ((h = 0; h < LEARNER_HOSTS; h++)); do
  LEARNER_IPS+=("\$(gcloud compute tpus tpu-vm describe $TPU --zone $ZONE --format='value(networkEndpoints[$h].ipAddress)')")
done
TRUSTED=${HCJAX_TRUSTED_PEERS:-$(IFS=,; echo "${LEARNER_IPS[*]}")}
for ((h = LEARNER_HOSTS; h < NUM_HOSTS; h++)); do
  INFERENCE+=("--inference_address" "\$(gcloud compute tpus tpu-vm describe $TPU --zone $ZONE --format='value(networkEndpoints[$h].ipAddress)'):$PORT")
done

run_on() {  # run_on WORKER COMMAND
  local cmd="gcloud compute tpus tpu-vm ssh $TPU --zone $ZONE --worker=$1 --command=\"cd $REPO && $2\""
  if [[ $DRY_RUN == 1 ]]; then echo "$cmd"; else eval "$cmd" & fi
}

for ((h = LEARNER_HOSTS; h < NUM_HOSTS; h++)); do
  run_on "$h" "${SECURITY}HCJAX_TRUSTED_PEERS=$TRUSTED .venv/bin/python -m hcjax.serve --host 0.0.0.0 --port $PORT $SIZES$GIN_Q"
done
for ((h = 0; h < LEARNER_HOSTS; h++)); do
  run_on "$h" "$SECURITY.venv/bin/python -m hcjax.climb --output_dir $OUTPUT_DIR --coordinator_address $COORD --num_processes $LEARNER_HOSTS --process_id $h ${INFERENCE[*]}$EXTRA_Q"
done
if [[ $DRY_RUN == 0 ]]; then wait; fi
