"""The accelerator table: each chip's peak FLOPs and HBM, and each link's bandwidth (ICI, DCN,
NVLink, the GPU cluster fabric), every figure with its public source. The planner's roofline and
the weight-sync estimate (hcjax.transfer.network) both read it; it is data only and imports
nothing of hcjax or JAX."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

__all__ = ["CHIPS", "LINKS", "Chip", "Link", "chips_of"]


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip's peaks (bytes and bytes/s, not bits).

    peak_flops: by the dtype of the matmul inputs. Only bf16 is filled: every step the planner
    compiles runs its matmuls in bf16; a dtype gets a row (with its source) when something
    computes in it.
    hbm_bytes: what XLA lets a program use, not the marketed capacity (see CHIPS).
    """

    peak_flops: Mapping[str, float]
    hbm_bytes: float
    hbm_bytes_per_s: float
    source: str


@dataclasses.dataclass(frozen=True)
class Link:
    """One link kind's bandwidth per chip or GPU (TPU ICI is all of a chip's ICI links together;
    DCN, NVLink and the GPU fabric are per accelerator). chips_per_host: where the link is the
    host's NICs shared by its chips, how many chips share them (None for chip-to-chip links)."""

    bytes_per_s: float
    source: str
    chips_per_host: int | None = None


# HBM capacity is what XLA lets a program use (its out-of-memory messages print it: 95.74 GiB of
# v5p's 96 GiB, 15.75 GiB of v5e's 16 GiB, 31.25 GiB of v6e's 32 GiB; v4 taken as 32 GiB less the
# same 0.25 GiB reserve), so "fits" agrees with the compiler.
CHIPS: dict[str, Chip] = {
    "v4": Chip({"bfloat16": 275e12}, 31.75 * 2**30, 1200e9,
               "cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 32 GiB HBM at 1200 GB/s"),
    "v5e": Chip({"bfloat16": 197e12}, 15.75 * 2**30, 819e9,
                "cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GB HBM at 819 GB/s"),
    "v5p": Chip({"bfloat16": 459e12}, 95.74 * 2**30, 2765e9,
                "cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GB HBM at 2765 GB/s"),
    "v6e": Chip({"bfloat16": 918e12}, 31.25 * 2**30, 1640e9,
                "cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GB HBM at 1640 GB/s"),
}

# Public figures, per chip or GPU in bytes/s (divided by 8 where the source gives bits). Keys are
# "<chip>-<link>"; a chip kind with no row for a link has no public figure for it.
LINKS: dict[str, Link] = {
    # Cloud TPU chip tables, "Interchip Interconnect BW" per chip (given in Gbps). The v4 page
    # gives no per-chip figure: 6 links x 50 GB/s from the TPU v4 paper -- the least sure entry.
    "v4-ici": Link(300e9, "TPU v4 paper (Jouppi et al., ISCA 2023): 6 ICI links x 50 GB/s per "
                   "chip"),
    "v5e-ici": Link(1600e9 / 8, "cloud.google.com/tpu/docs/v5e: ICI 1600 Gbps per chip"),
    "v5p-ici": Link(4800e9 / 8, "cloud.google.com/tpu/docs/v5p: ICI 4800 Gbps per chip"),
    "v6e-ici": Link(3584e9 / 8, "cloud.google.com/tpu/docs/v6e: ICI 3584 Gbps per chip"),
    # cloud.google.com/tpu/docs/v5p, specification table: "Data center network (DCN) bandwidth
    # per chip (Gbps): 50"; 4-chip VMs (v5p:2x2x1 = 4 chips, 1 host).
    "v5p-dcn": Link(50e9 / 8, "cloud.google.com/tpu/docs/v5p: DCN 50 Gbps per chip, 4 chips per "
                    "host", chips_per_host=4),
    # cloud.google.com/tpu/docs/v5e: "Per-host NIC configuration: 2 x 100 Gbps NIC", 8 chips per
    # host (25 Gbps per chip; the pod's 6.4 Tbps DCN over 256 chips agrees).
    "v5e-dcn": Link(2 * 100e9 / 8 / 8, "cloud.google.com/tpu/docs/v5e: 2 x 100 Gbps NIC per "
                    "host, 8 chips per host", chips_per_host=8),
    # NVIDIA H100 SXM datasheet: NVLink 900 GB/s per GPU (fourth-generation NVLink, 18 links).
    "h100-nvlink": Link(900e9, "NVIDIA H100 SXM datasheet: NVLink 900 GB/s per GPU, 8 GPUs per "
                        "HGX node", chips_per_host=8),
    # NVIDIA DGX H100 datasheet: 8 x ConnectX-7 single-port 400 Gb/s InfiniBand/Ethernet, one per
    # GPU (the compute fabric; the storage NICs are not counted).
    "h100-fabric": Link(400e9 / 8, "NVIDIA DGX H100 datasheet: 8 x 400 Gb/s ConnectX-7 "
                        "(InfiniBand/RoCE), one per GPU", chips_per_host=8),
}

# Every kind the table names: the chips, and the accelerators it knows only links of (GPUs).
_KINDS = sorted({*CHIPS, *(name.partition("-")[0] for name in LINKS)})
_TOPOLOGY_RE = re.compile(r"^([a-z0-9]+):(\d+(?:x\d+)*)$")


def chips_of(topology: str, num_slices: int = 1) -> tuple[str, int]:
    """("v5p", 1024) for "v5p:8x8x16" (times `num_slices`); "h100:16x8" is 16 nodes of 8 GPUs."""
    m = _TOPOLOGY_RE.match(topology)
    if not m or m.group(1) not in _KINDS:
        raise ValueError(f"topology={topology!r} is not '<kind>:<AxBxC>' (like 'v5p:8x8x16' or "
                         f"'h100:16x8') with kind one of {_KINDS}")
    return m.group(1), math.prod(int(d) for d in m.group(2).split("x")) * num_slices
