"""`python -m hcjax.cluster.jobset`: print a GKE JobSet manifest (YAML) for a climb on TPU slices:
replicated job `learner` (one Job per learner slice, one pod per host, all in one JAX job, slices
joined over DCN by MEGASCALE_*), replicated job `inference` (one single-host slice per replica,
`hcjax.serve` with a readiness probe on its Health RPC). The image must hold the repository and
jax[tpu]; a gs:// output_dir is mounted with the GKE gcsfuse CSI driver.

  python -m hcjax.cluster.jobset --name climb --image IMAGE --learner_topology v5p-64 \\
      --learner_slices 2 --inference_topology v5p-8 --inference_replicas 2 \\
      --output_dir gs://BUCKET/run --token_secret hcjax-token [-- extra climb flags]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence

from hcjax.cluster.layout import (
    COORDINATOR_PORT,
    MEGASCALE_PORT,
    SERVE_PORT,
    _learner_argv,
    _serve_argv,
    storage_steps,
    tpu_slice,
    wait_step,
)
from hcjax.cluster.storage import gcs_mount

__all__ = ["jobset"]

PYTHON = "python"
TOKEN_PATH = "/var/run/hcjax/token"


def _q(value: str) -> str:
    """A YAML scalar: JSON strings are valid YAML double-quoted scalars."""
    return json.dumps(value)


def _pod_dns(name: str, job: str, index: int, pod: int) -> str:
    # JobSet gives each pod the hostname NAME-JOB-INDEX-POD in the headless service NAME.
    return f"{name}-{job}-{index}-{pod}.{name}"


def _env_lines(env: dict[str, str], field_refs: dict[str, str], indent: str) -> list[str]:
    lines = [f"{indent}env:"]
    for k, v in env.items():
        lines += [f"{indent}- name: {k}", f"{indent}  value: {_q(v)}"]
    for k, path in field_refs.items():
        lines += [f"{indent}- name: {k}", f"{indent}  valueFrom:",
                  f"{indent}    fieldRef:", f"{indent}      fieldPath: {_q(path)}"]
    return lines


def _job(name: str, job: str, replicas: int, hosts: int, shape, image: str, script: str,
         env: dict[str, str], field_refs: dict[str, str], bucket: str | None,
         token_secret: str | None, probe: Sequence[str] | None) -> list[str]:
    i = "              "  # container fields
    lines = [
        f"  - name: {job}",
        f"    replicas: {replicas}",
        "    template:",
        "      spec:",
        f"        parallelism: {hosts}",
        f"        completions: {hosts}",
        "        completionMode: Indexed",
        "        backoffLimit: 0",
        "        template:",
        "          metadata:",
        "            annotations:",
        f"              gke-gcsfuse/volumes: {_q('true' if bucket else 'false')}",
        "          spec:",
        "            restartPolicy: Never",
        "            nodeSelector:",
        f"              cloud.google.com/gke-tpu-accelerator: {shape.gke_accelerator}",
        f"              cloud.google.com/gke-tpu-topology: {shape.gke_topology}",
        "            containers:",
        "            - name: hcjax",
        f"              image: {_q(image)}",
        f"              command: [\"bash\", \"-c\", {_q(script)}]",
        "              ports:",
        f"              - containerPort: {SERVE_PORT}",
        f"              - containerPort: {COORDINATOR_PORT}",
        f"              - containerPort: {MEGASCALE_PORT}",
        "              resources:",
        "                limits:",
        f"                  google.com/tpu: {shape.chips_per_host}",
        *_env_lines(env, field_refs, i),
    ]
    if probe:
        lines += [f"{i}readinessProbe:", f"{i}  exec:",
                  f"{i}    command: [{', '.join(map(_q, probe))}]",
                  f"{i}  periodSeconds: 10", f"{i}  timeoutSeconds: 10"]
    mounts, volumes = [], []
    if bucket:
        mounts += [f"{i}- name: output", f"{i}  mountPath: /mnt/gcs/{bucket}"]
        volumes += ["            - name: output", "              csi:",
                    "                driver: gcsfuse.csi.storage.gke.io",
                    "                volumeAttributes:",
                    f"                  bucketName: {_q(bucket)}",
                    "                  mountOptions: \"implicit-dirs\""]
    if token_secret:
        mounts += [f"{i}- name: token", f"{i}  mountPath: {_q(TOKEN_PATH.rsplit('/', 1)[0])}",
                   f"{i}  readOnly: true"]
        volumes += ["            - name: token", "              secret:",
                    f"                secretName: {_q(token_secret)}",
                    "                items:", "                - key: token",
                    "                  path: token"]
    if mounts:
        lines += [f"{i}volumeMounts:", *mounts, "            volumes:", *volumes]
    return lines


def jobset(*, name: str, image: str, learner_topology: str, learner_slices: int,
           inference_topology: str, inference_replicas: int, output_dir: str,
           extra: Sequence[str] = (), sizes: Sequence[str] = (),
           token_secret: str | None = None) -> str:
    """The JobSet manifest as YAML text."""
    learner, inference = tpu_slice(learner_topology), tpu_slice(inference_topology)
    if inference.hosts != 1:
        raise ValueError(f"inference_topology={inference_topology} has {inference.hosts} hosts; "
                         "an inference process uses one host: pick a single-host slice")
    if learner_slices < 1 or inference_replicas < 1:
        raise ValueError(f"learner_slices={learner_slices} and inference_replicas="
                         f"{inference_replicas} must be >= 1")
    path, bucket = gcs_mount(output_dir)
    addresses = [f"{_pod_dns(name, 'inference', r, 0)}:{SERVE_PORT}"
                 for r in range(inference_replicas)]
    learner_pods = [_pod_dns(name, "learner", s, w) for s in range(learner_slices)
                    for w in range(learner.hosts)]
    security = {"HCJAX_TOKEN_FILE": TOKEN_PATH} if token_secret else {}
    num = len(learner_pods)
    argv = _learner_argv(PYTHON, path, f"{learner_pods[0]}:{COORDINATOR_PORT}", num, 0,
                         addresses, extra)
    climb = " ".join(map(shlex.quote, argv))
    if num > 1:  # each pod's process id: slices in order, hosts in order within a slice
        climb = climb.replace("--process_id 0",
                              f"--process_id $((SLICE_ID * {learner.hosts} + WORKER_ID))")
    _, storage = storage_steps(path, PYTHON)  # the CSI driver mounts gs://; only the check runs
    script = " && ".join([*storage, wait_step(PYTHON, addresses), climb])
    env = dict(security)
    refs = {"WORKER_ID": "metadata.annotations['batch.kubernetes.io/job-completion-index']",
            "SLICE_ID": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}
    if learner_slices > 1:
        env.update(MEGASCALE_COORDINATOR_ADDRESS=f"{learner_pods[0]}:{MEGASCALE_PORT}",
                   MEGASCALE_NUM_SLICES=str(learner_slices), MEGASCALE_PORT=str(MEGASCALE_PORT))
        refs["MEGASCALE_SLICE_ID"] = refs["SLICE_ID"]
    serve = " ".join(map(shlex.quote, _serve_argv(PYTHON, SERVE_PORT, sizes, extra)))
    serve_env = {**security, "HCJAX_TRUSTED_PEERS": ",".join(learner_pods)}
    probe = [PYTHON, "-m", "hcjax.cluster.wait_ready", f"127.0.0.1:{SERVE_PORT}", "--timeout",
             "5"]
    lines = [
        "apiVersion: jobset.x-k8s.io/v1alpha2",
        "kind: JobSet",
        "metadata:",
        f"  name: {name}",
        "  annotations:",
        "    alpha.jobset.sigs.k8s.io/exclusive-topology: cloud.google.com/gke-nodepool",
        "spec:",
        "  failurePolicy:",
        "    maxRestarts: 3",
        "  network:",
        "    enableDNSHostnames: true",
        "  replicatedJobs:",
        *_job(name, "inference", inference_replicas, 1, inference, image, serve, serve_env, {},
              None, token_secret, probe),
        *_job(name, "learner", learner_slices, learner.hosts, learner, image, script, env, refs,
              bucket, token_secret, None),
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="hcjax-climb")
    parser.add_argument("--image", required=True)
    parser.add_argument("--learner_topology", required=True, help="e.g. v5p-64")
    parser.add_argument("--learner_slices", type=int, default=1)
    parser.add_argument("--inference_topology", required=True, help="e.g. v5p-8")
    parser.add_argument("--inference_replicas", type=int, default=1)
    parser.add_argument("--output_dir", required=True, help="gs://BUCKET/PATH or a mounted path")
    parser.add_argument("--token_secret", default=None,
                        help="Kubernetes secret with key 'token' (mounted as HCJAX_TOKEN_FILE)")
    parser.add_argument("--sizes", default="--max_prefill_length 32 --max_concurrent_decodes 128")
    args, extra = parser.parse_known_args(argv)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    try:
        print(jobset(name=args.name, image=args.image, learner_topology=args.learner_topology,
                     learner_slices=args.learner_slices,
                     inference_topology=args.inference_topology,
                     inference_replicas=args.inference_replicas, output_dir=args.output_dir,
                     extra=extra, sizes=args.sizes.split(), token_secret=args.token_secret),
              end="")
    except ValueError as err:
        print(f"hcjax.cluster.jobset: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)
