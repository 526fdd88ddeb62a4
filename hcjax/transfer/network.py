"""How long a weight push takes over the path between the learner and the inference chips: an
estimate from public link figures (hcjax.hardware.LINKS), for full pushes and for delta pushes at
a stated fraction of changed elements (hcjax.transfer.delta's sparse encoding: a uint32 index
beside each changed value). `hcjax.plan` prints it; it is a bandwidth bound, not a measurement.

Paths:
  ici   learner and inference on one slice: each inference chip receives its share of the bytes
        over its own ICI links.
  dcn   separate TPU slices: the bytes leave the learner hosts and enter the inference hosts over
        the data-centre network, each host at its NICs' rate; the narrower side bounds the push
        (hosts x per-host bandwidth). One copy crosses; data-parallel inference replicas are then
        filled from it over the inference slice's ICI (counted as `fanout_s`).
  gpu   GPU nodes: NVLink inside a node, the cluster fabric (InfiniBand/RoCE) between nodes,
        the narrower side's GPUs x per-GPU fabric bandwidth.
"""

from __future__ import annotations

import dataclasses

import gin

from hcjax.hardware import LINKS, Link, chips_of

__all__ = ["SyncPathConfig", "summary_lines", "sync_estimate"]


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SyncPathConfig:
    """The weight-sync estimate's assumptions (hcjax.plan).

    path: "auto" (ici when learner and inference share the topology string and no separate
    inference topology is given, else dcn on TPU, gpu on GPU), "ici", "dcn" or "gpu".
    changed_fraction: the fraction of served (bf16) elements a delta push carries; default
    0.05%, the upper end of what early RL on an MoE changes per step (the issue's figure;
    measure yours with `python -m hcjax.bench.sync`).
    dcn_bytes_per_s_per_chip: overrides the table (needed for v4 and v6e: no public per-chip DCN
    figure in the table).
    """

    path: str = "auto"
    changed_fraction: float = 0.0005
    dcn_bytes_per_s_per_chip: float | None = None

    def __post_init__(self) -> None:
        if self.path not in ("auto", "ici", "dcn", "gpu"):
            raise ValueError(f"SyncPathConfig.path={self.path!r} must be auto, ici, dcn or gpu")
        if not 0.0 <= self.changed_fraction <= 1.0:
            raise ValueError(f"SyncPathConfig.changed_fraction={self.changed_fraction} must be "
                             "in [0, 1]")


def _dcn(chip: str, cfg: SyncPathConfig) -> tuple[float, int, str]:
    if cfg.dcn_bytes_per_s_per_chip is not None:
        per_host = LINKS[f"{chip}-dcn"].chips_per_host if f"{chip}-dcn" in LINKS else 4
        return cfg.dcn_bytes_per_s_per_chip, per_host, "SyncPathConfig.dcn_bytes_per_s_per_chip"
    if f"{chip}-dcn" not in LINKS:
        raise ValueError(f"no DCN figure for {chip} in hcjax.hardware.LINKS; set "
                         "SyncPathConfig.dcn_bytes_per_s_per_chip")
    link = LINKS[f"{chip}-dcn"]
    return link.bytes_per_s, link.chips_per_host, link.source


def _ici(chip: str, what: str) -> Link:
    if f"{chip}-ici" not in LINKS:
        raise ValueError(f"{what} needs an ICI figure for {chip}; hcjax.hardware.LINKS has none")
    return LINKS[f"{chip}-ici"]


def sync_estimate(nbytes: float, learner_topology: str, inference_topology: str | None, *,
                  inference_replicas: int = 1,
                  learner_slices: int = 1, inference_slices: int = 1, value_bytes: int = 2,
                  cfg: SyncPathConfig | None = None) -> dict:
    """Estimated seconds to push `nbytes` of served weights (one copy), full and delta.

    inference_replicas: data-parallel inference replicas; on the dcn path one copy crosses and
    the others are filled from it over the inference chips' ICI.
    value_bytes: bytes of one served element (2 for bf16): a delta sends 4 + value_bytes per
    changed element."""
    cfg = cfg or SyncPathConfig()
    chip, l_chips = chips_of(learner_topology, learner_slices)
    i_chip, i_chips = chips_of(inference_topology or learner_topology, inference_slices)
    path = cfg.path
    if path == "auto":
        path = ("gpu" if chip == "h100" else
                "ici" if inference_topology is None and learner_slices == inference_slices == 1
                else "dcn")
    delta_bytes = nbytes * cfg.changed_fraction * (4 + value_bytes) / value_bytes
    assumptions = [
        "bandwidth only: no latency, no per-chunk overhead, no host encode/decode time",
        f"delta: {cfg.changed_fraction:.4%} of elements changed, each sent as a uint32 index "
        f"and its {value_bytes}-byte value",
    ]
    links: dict[str, dict] = {}
    fanout_s = 0.0
    if path == "ici":
        ici = _ici(i_chip, "the ici path")
        rate = i_chips * ici.bytes_per_s
        links["ici"] = {"bytes_per_s": ici.bytes_per_s, "per": "inference chip",
                        "source": ici.source}
        narrowest = f"ICI of {i_chips} inference chips ({rate / 1e9:,.0f} GB/s)"
        per_host = {"inference_chip": nbytes / i_chips}
        assumptions.append("same slice: every inference chip receives its share over its own "
                           "ICI links at full rate")
    elif path == "dcn":
        if chip != i_chip:
            raise ValueError(f"dcn path between {chip} and {i_chip}: one chip kind per side")
        per_chip, chips_per_host, source = _dcn(chip, cfg)
        l_hosts, i_hosts = l_chips // chips_per_host or 1, i_chips // chips_per_host or 1
        host_rate = per_chip * chips_per_host
        side, hosts = ("learner", l_hosts) if l_hosts <= i_hosts else ("inference", i_hosts)
        rate = hosts * host_rate
        links["dcn"] = {"bytes_per_s": host_rate, "per": "host", "source": source}
        narrowest = (f"DCN, {side} side: {hosts} hosts x {host_rate * 8 / 1e9:,.0f} Gb/s = "
                     f"{rate / 1e9:,.1f} GB/s")
        per_host = {"learner_host": nbytes / l_hosts, "inference_host": nbytes / i_hosts}
        if inference_replicas > 1:
            ici = _ici(i_chip, "the fan-out to inference replicas")
            fanout_s = nbytes / (i_chips / inference_replicas * ici.bytes_per_s)
            links["ici"] = {"bytes_per_s": ici.bytes_per_s, "per": "inference chip",
                            "source": ici.source}
        assumptions += [
            f"separate slices: one copy crosses the DCN, every host at its NICs' full rate "
            f"({l_hosts} learner hosts, {i_hosts} inference hosts, {chips_per_host} chips each)",
            f"{inference_replicas} data-parallel inference replica(s): the others are filled "
            "from the first over ICI, after the DCN copy (not overlapped)",
        ]
    else:
        nvlink, fabric = LINKS["h100-nvlink"], LINKS["h100-fabric"]
        gpus = min(l_chips, i_chips)
        rate = gpus * fabric.bytes_per_s
        links["nvlink"] = {"bytes_per_s": nvlink.bytes_per_s, "per": "GPU",
                           "source": nvlink.source}
        links["fabric"] = {"bytes_per_s": fabric.bytes_per_s, "per": "GPU",
                           "source": fabric.source}
        narrowest = (f"cluster fabric: {gpus} GPUs x {fabric.bytes_per_s * 8 / 1e9:,.0f} Gb/s "
                     f"= {rate / 1e9:,.1f} GB/s")
        per_host = {"learner_node": nbytes / max(1, l_chips // fabric.chips_per_host),
                    "inference_node": nbytes / max(1, i_chips // fabric.chips_per_host)}
        assumptions.append("learner and inference on different nodes: bytes cross the fabric, "
                           "one NIC per GPU at full rate (NVLink inside a node is faster)")
    return {
        "path": path, "estimate": True, "links": links, "narrowest": narrowest,
        "bytes_per_host": per_host, "assumptions": assumptions,
        "full": {"bytes": nbytes, "estimated_s": nbytes / rate + fanout_s,
                 "fanout_s": fanout_s},
        "delta": {"changed_fraction": cfg.changed_fraction, "bytes": delta_bytes,
                  "estimated_s": delta_bytes / rate + fanout_s * cfg.changed_fraction
                  * (4 + value_bytes) / value_bytes},
    }


def summary_lines(est: dict) -> list[str]:
    """The estimate for hcjax.plan's summary."""
    if "error" in est:
        return [f"weight sync: no estimate ({est['error']})"]
    full, delta = est["full"], est["delta"]
    lines = [
        f"weight sync over {est['path'].upper()} (estimate, bandwidth bound): full "
        f"{full['bytes'] / 1e9:,.1f} GB in ~{full['estimated_s']:.2f} s"
        + (f" (incl. ICI fan-out {full['fanout_s']:.2f} s)" if full["fanout_s"] else "")
        + f"; delta at {delta['changed_fraction']:.3%} changed {delta['bytes'] / 1e9:,.2f} GB "
        f"in ~{delta['estimated_s']:.3f} s",
        f"  narrowest link: {est['narrowest']}; bytes per "
        + ", ".join(f"{k} {v / 1e9:,.2f} GB" for k, v in est["bytes_per_host"].items()),
    ]
    lines += [f"  {name}: {link['source']}" for name, link in est["links"].items()]
    lines += [f"  assumes: {a}" for a in est["assumptions"]]
    return lines
