#!/usr/bin/env bash
# Climb on Cloud TPU VMs, each role on whole slices: the learner on one or more slices (every host
# of every learner slice in one JAX job: jax.distributed with worker 0 of the first slice as
# coordinator; several slices joined over DCN by the MEGASCALE_* variables of multislice JAX), and
# one inference process (python -m hcjax.serve) per single-host inference slice. Per-process
# environment and command come from `python -m hcjax.cluster.layout tpu` (printed by --dry_run); for
# GKE, `python -m hcjax.cluster.jobset` prints the same climb as a JobSet manifest.
#
#   launch/tpu_pod.sh --zone ZONE --learner_tpus "L0 [L1 ...]" --learner_type v5p-64 \
#       --inference_tpus "I0 [I1 ...]" --inference_type v5p-8 --output_dir gs://BUCKET/run \
#       [--port P] [--repo DIR] [--dry_run] [-- extra flags]
#
# On every host: jax[tpu] is installed into DIR/.venv-accel if absent; a gs:// output_dir is
# mounted with gcsfuse at /mnt/gcs/BUCKET (or give a shared mount such as Filestore); each learner
# host checks that output_dir is shared and writable (hcjax.cluster.storage) and waits for every
# inference process's Health to answer SERVING (hcjax.cluster.wait_ready) before it starts.
# Extra flags go to the learner; the gin ones also to the inference processes. Engine sizes:
# $MAX_PREFILL_LENGTH (32), $MAX_CONCURRENT_DECODES (128), $MAX_TARGET_LENGTH (model's).
# Security: $HCJAX_TOKEN_FILE (a path present on every host) is required and passed on, as are
# $HCJAX_TLS_DIR and $HCJAX_TLS_SERVER_NAME; inference pulls weights only from the learner hosts.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
ZONE=""
LEARNER_TPUS=""
LEARNER_TYPE=""
INFERENCE_TPUS=""
INFERENCE_TYPE=""
PORT=50151
OUTPUT_DIR=""
REPO=${REPO_DIR:-\$HOME/hcjax}
MAX_PREFILL_LENGTH=${MAX_PREFILL_LENGTH:-32}
MAX_CONCURRENT_DECODES=${MAX_CONCURRENT_DECODES:-128}
MAX_TARGET_LENGTH=${MAX_TARGET_LENGTH:-}
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry_run) DRY_RUN=1; shift ;;
    --zone) ZONE="$2"; shift 2 ;;
    --learner_tpus) LEARNER_TPUS="$2"; shift 2 ;;
    --learner_type) LEARNER_TYPE="$2"; shift 2 ;;
    --inference_tpus) INFERENCE_TPUS="$2"; shift 2 ;;
    --inference_type) INFERENCE_TYPE="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --output_dir) OUTPUT_DIR="$2"; shift 2 ;;
    --repo) REPO="$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "tpu_pod.sh: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done
for v in ZONE LEARNER_TPUS LEARNER_TYPE INFERENCE_TPUS INFERENCE_TYPE OUTPUT_DIR; do
  if [[ -z "${!v}" ]]; then echo "tpu_pod.sh: --${v,,} is required" >&2; exit 2; fi
done
if [[ $DRY_RUN == 0 && -z "${HCJAX_TOKEN_FILE:-}" ]]; then
  echo "tpu_pod.sh: set HCJAX_TOKEN_FILE to a token file present on every host (the inference" \
    "processes serve 0.0.0.0 and refuse to run without a token)" >&2
  exit 2
fi
hosts_of() {  # hosts_of TPU TYPE: the slice's worker addresses, comma-separated, worker 0 first
  local n
  n=$(PYTHONPATH=. python3 -c "from hcjax.cluster.layout import tpu_slice; print(tpu_slice('$2').hosts)") || exit 2
  if [[ $DRY_RUN == 1 ]]; then  # stand-ins; a real run asks gcloud for the internal IPs
    local out=()
    for ((w = 0; w < n; w++)); do out+=("$1-w$w"); done
    (IFS=,; echo "${out[*]}")
    return
  fi
  local ips
  ips=$(gcloud compute tpus tpu-vm describe "$1" --zone "$ZONE" \
    --format='value[delimiter=","](networkEndpoints[].ipAddress)')
  if [[ $(tr ',' '\n' <<<"$ips" | wc -l) != "$n" ]]; then
    echo "tpu_pod.sh: TPU $1 has hosts '$ips', but $2 has $n" >&2; exit 2
  fi
  echo "$ips"
}
LEARNER=""
for t in $LEARNER_TPUS; do LEARNER+="$t=$(hosts_of "$t" "$LEARNER_TYPE");"; done
INFERENCE=""
for t in $INFERENCE_TPUS; do INFERENCE+="$t=$(hosts_of "$t" "$INFERENCE_TYPE");"; done
SIZES="--max_prefill_length $MAX_PREFILL_LENGTH --max_concurrent_decodes $MAX_CONCURRENT_DECODES"
if [[ -n "$MAX_TARGET_LENGTH" ]]; then SIZES+=" --max_target_length $MAX_TARGET_LENGTH"; fi
LAYOUT=$(PYTHONPATH=. python3 -m hcjax.cluster.layout tpu --learner "$LEARNER" \
  --inference "$INFERENCE" --port "$PORT" --output_dir "$OUTPUT_DIR" --sizes "$SIZES" \
  -- "${EXTRA[@]}")
PYTHONPATH=. python3 -m hcjax.cluster.layout tpu --learner "$LEARNER" --inference "$INFERENCE" \
  --output_dir "$OUTPUT_DIR" --slice_of_hosts >/tmp/hcjax_slices.$$  # host -> "TPU WORKER"
declare -A WHERE
while read -r host tpu worker; do WHERE[$host]="$tpu $worker"; done </tmp/hcjax_slices.$$
rm -f /tmp/hcjax_slices.$$
PIDS=()
while read -r role host script; do
  read -r tpu worker <<<"${WHERE[$host]}"
  cmd=(gcloud compute tpus tpu-vm ssh "$tpu" --zone "$ZONE" --worker="$worker"
       --command="cd $REPO && $script")
  if [[ $DRY_RUN == 1 ]]; then echo "$role: $(printf '%q ' "${cmd[@]}")"; continue; fi
  "${cmd[@]}" &
  PIDS+=("$!")
done <<<"$LAYOUT"
if [[ $DRY_RUN == 0 ]]; then wait "${PIDS[@]}"; fi
