#!/usr/bin/env bash
# Climb on a Cloud TPU pod slice: every host runs its part. Hosts [0, LEARNER_HOSTS) form the
# learner job (jax.distributed.initialize with host 0 as coordinator; host 0 also runs the
# controller); the other hosts are inference processes on their own chips.
#
#   launch/tpu_pod.sh --tpu NAME --zone ZONE --num_hosts H [--learner_hosts L] [--port P]
#                     [--dry_run] [-- extra flags for every process]
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

# Internal addresses come from the TPU's description; the coordinator is worker 0.
COORD="\$(gcloud compute tpus tpu-vm describe $TPU --zone $ZONE --format='value(networkEndpoints[0].ipAddress)'):$COORD_PORT"
INFERENCE=()
for ((h = LEARNER_HOSTS; h < NUM_HOSTS; h++)); do
  INFERENCE+=("--inference_address" "\$(gcloud compute tpus tpu-vm describe $TPU --zone $ZONE --format='value(networkEndpoints[$h].ipAddress)'):$PORT")
done

run_on() {  # run_on WORKER COMMAND
  local cmd="gcloud compute tpus tpu-vm ssh $TPU --zone $ZONE --worker=$1 --command=\"cd $REPO && $2\""
  if [[ $DRY_RUN == 1 ]]; then echo "$cmd"; else eval "$cmd" & fi
}

for ((h = LEARNER_HOSTS; h < NUM_HOSTS; h++)); do
  run_on "$h" ".venv/bin/python -m hcjax.climb --role inference --host 0.0.0.0 --port $PORT$EXTRA_Q"
done
for ((h = 0; h < LEARNER_HOSTS; h++)); do
  run_on "$h" ".venv/bin/python -m hcjax.climb --output_dir $OUTPUT_DIR --coordinator_address $COORD --num_processes $LEARNER_HOSTS --process_id $h ${INFERENCE[*]}$EXTRA_Q"
done
if [[ $DRY_RUN == 0 ]]; then wait; fi
