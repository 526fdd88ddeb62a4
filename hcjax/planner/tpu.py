"""libtpu's compile-only TPU devices for a topology name, loaded quietly on a host without TPU
chips. The planner is the one part of hcjax that loads libtpu; nothing here allocates on a
device."""

from __future__ import annotations

import glob
import os

from jax.experimental import topologies

from hcjax.hardware import CHIPS, chips_of
from hcjax.planner.cost import DeviceSpec

__all__ = ["tpu_devices"]

# What libtpu asks a TPU VM's metadata server for when it loads. On a host with no TPU chips
# nothing answers, and it prints "could not determine TPU accelerator type" and an E0000
# INVALID_ARGUMENT trace about the worker hostnames. A one-host slice named localhost answers
# both; compile-only devices take their shape from the topology name, not from these (the
# programs compiled for v4, v5e, v5p, v6e and two slices are the same with and without them).
_NO_TPU_HOST_ENV = {"TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_HOSTNAMES": "localhost"}
_TOPOLOGY_ENV = ("TPU_ACCELERATOR_TYPE", "TPU_HOST_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS",
                 "TPU_WORKER_HOSTNAMES")


def _libtpu_environment() -> None:
    """Set what libtpu reads, before it loads; only in the planner's process."""
    # Compile-only devices touch no chip, so several processes (a plan beside the test suite) may
    # load libtpu at once; without this the second one fails on libtpu's lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    on_tpu_vm = glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
    if on_tpu_vm or any(name in os.environ for name in _TOPOLOGY_ENV):
        return  # libtpu finds its slice itself, or the user described one
    os.environ.update(_NO_TPU_HOST_ENV)


def tpu_devices(topology: str, num_slices: int = 1) -> tuple[list, DeviceSpec, int]:
    """(compile-only devices, per-device spec, chips) for a name like "v5p:8x8x16", times
    `num_slices` slices joined over DCN (devices slice-major)."""
    chip, chips = chips_of(topology, num_slices)
    if chip not in CHIPS:
        raise ValueError(f"topology={topology!r}: {chip} is not a TPU the planner compiles for "
                         f"(one of {sorted(CHIPS)})")
    _libtpu_environment()
    try:
        kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
        devices = list(topologies.get_topology_desc(topology, platform="tpu", **kwargs).devices)
    except Exception as e:  # libtpu missing, or a shape it rejects
        raise ValueError(f"topology={topology!r}: libtpu could not build it ({e})") from e
    # v4 exposes each TensorCore as a device
    return devices, DeviceSpec.of(chip, max(1, len(devices) // chips)), chips
