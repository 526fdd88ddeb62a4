"""`python -m hcjax.cluster.storage DIR`: check at start that a climb's output folder (config,
checkpoints, rollouts) is on storage every host shares and can write; exit 2 naming the problem.
A multi-host climb that writes checkpoints to one host's local disk cannot resume elsewhere."""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Sequence

# Filesystems that several hosts mount as one (network, parallel, FUSE-backed buckets).
SHARED_TYPES = {"nfs", "nfs4", "fuse.gcsfuse", "lustre", "gpfs", "beegfs", "cifs", "smb3",
                "ceph", "fuse.ceph-fuse", "glusterfs", "fuse.glusterfs", "wekafs", "fuse.s3fs",
                "fuse.juicefs", "fuse.rclone"}


def gcs_mount(path: str, root: str = "/mnt/gcs") -> tuple[str, str | None]:
    """gs://BUCKET/PATH -> (ROOT/BUCKET/PATH, BUCKET); any other path -> (path, None)."""
    if not path.startswith("gs://"):
        return path, None
    bucket, _, rest = path[len("gs://"):].partition("/")
    if not bucket:
        raise ValueError(f"output_dir={path!r} names no bucket")
    return os.path.join(root, bucket, rest).rstrip("/"), bucket


def filesystem_type(path: str, mounts: str = "/proc/mounts") -> str:
    """The type of the filesystem holding `path` (the longest mount point above it)."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    with open(mounts, encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 3:
                continue
            point = fields[1].replace("\\040", " ")
            if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                best, kind = point, fields[2]
    return kind


def check(path: str, *, allow_local: bool = False, mounts: str = "/proc/mounts") -> str:
    """Create `path` if needed, write and remove a probe file; unless allow_local, require a
    shared filesystem. Returns its filesystem type; ValueError naming the problem otherwise."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".hcjax-probe-{uuid.uuid4().hex}")
        with open(probe, "w", encoding="utf-8") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as err:
        raise ValueError(f"output_dir={path!r} is not writable here: {err.strerror}") from None
    kind = filesystem_type(path, mounts)
    if not allow_local and kind not in SHARED_TYPES:
        raise ValueError(
            f"output_dir={path!r} is on a {kind!r} filesystem, local to this host: checkpoints "
            "there are lost with the host and other hosts cannot resume from them. Use a "
            "gs://BUCKET/PATH (mounted with gcsfuse) or a shared mount (NFS, Filestore, Lustre), "
            "or set HCJAX_ALLOW_LOCAL_OUTPUT=1 for a single-host run")
    return kind


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    args = parser.parse_args(argv)
    try:
        kind = check(args.path, allow_local=os.environ.get("HCJAX_ALLOW_LOCAL_OUTPUT") == "1")
    except ValueError as err:
        print(f"hcjax.cluster.storage: {err}", file=sys.stderr)
        return 2
    print(f"hcjax.cluster.storage: {args.path} ({kind}) ok", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)
