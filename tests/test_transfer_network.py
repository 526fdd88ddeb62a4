"""The weight-sync estimate (hcjax.transfer.network): hand-computed figures for each path and its
sources in the record, read from one table of links (hcjax.hardware). `python -m hcjax.plan`
printing it without compiling anything is tested in tests/test_plan.py."""

import pytest

from hcjax import hardware
from hcjax.hardware import chips_of
from hcjax.transfer import network


def test_dcn_is_bounded_by_the_narrower_side_s_hosts():
    # v5p: 50 Gb/s per chip, 4 chips a host. 1024 learner chips = 256 hosts; 128 inference chips
    # = 32 hosts x 25 GB/s = 800 GB/s, the narrower side.
    est = network.sync_estimate(1e12, "v5p:8x8x16", "v5p:4x4x8")
    assert est["path"] == "dcn" and est["estimate"] is True
    assert est["full"]["estimated_s"] == pytest.approx(1e12 / 800e9)
    assert est["bytes_per_host"] == {"learner_host": 1e12 / 256, "inference_host": 1e12 / 32}
    assert "inference side: 32 hosts" in est["narrowest"]
    assert "cloud.google.com/tpu/docs/v5p" in est["links"]["dcn"]["source"]
    # delta: 0.05% of elements, 4 + 2 bytes each for bf16
    assert est["delta"]["bytes"] == pytest.approx(1e12 * 0.0005 * 3)
    assert est["delta"]["estimated_s"] == pytest.approx(1e12 * 0.0005 * 3 / 800e9)
    # 8 data-parallel replicas of 16 chips: the other 7 filled over ICI, 1e12 / (16 x 600 GB/s)
    fan = network.sync_estimate(1e12, "v5p:8x8x16", "v5p:4x4x8",
                                inference_replicas=8)
    assert fan["full"]["fanout_s"] == pytest.approx(1e12 / (16 * 600e9))
    assert fan["full"]["estimated_s"] == pytest.approx(1e12 / 800e9 + 1e12 / (16 * 600e9))


def test_ici_and_gpu_paths():
    ici = network.sync_estimate(1e12, "v5p:2x2x1", None)
    assert ici["path"] == "ici" and ici["full"]["estimated_s"] == pytest.approx(1e12 / 2.4e12)
    # 16 nodes of 8 H100 -> 4 nodes: 32 GPUs x 400 Gb/s on the narrower side
    gpu = network.sync_estimate(1e12, "h100:16x8", "h100:4x8")
    assert gpu["path"] == "gpu" and gpu["full"]["estimated_s"] == pytest.approx(1e12 / 1.6e12)
    assert "NVLink 900 GB/s" in gpu["links"]["nvlink"]["source"]
    lines = network.summary_lines(gpu)
    assert lines[0].startswith("weight sync over GPU (estimate")


def test_missing_figures_and_bad_settings_are_named():
    with pytest.raises(ValueError, match="no DCN figure for v6e.*dcn_bytes_per_s_per_chip"):
        network.sync_estimate(1e9, "v6e:16x16", "v6e:8x8")
    cfg = network.SyncPathConfig(dcn_bytes_per_s_per_chip=1e10)
    est = network.sync_estimate(1e9, "v6e:16x16", "v6e:8x8", cfg=cfg)
    assert est["full"]["estimated_s"] == pytest.approx(1e9 / (64 * 1e10))
    assert network.summary_lines({"error": "no DCN figure"}) == [
        "weight sync: no estimate (no DCN figure)"]
    with pytest.raises(ValueError, match="changed_fraction=2"):
        network.SyncPathConfig(changed_fraction=2)
    with pytest.raises(ValueError, match="topology='tpu'"):
        chips_of("tpu")
    with pytest.raises(ValueError, match="ICI figure for h100"):
        network.sync_estimate(1e9, "h100:2x8", None, cfg=network.SyncPathConfig(path="ici"))


def test_the_table_gives_every_figure_a_source_and_parses_topologies():
    for name, entry in {**hardware.CHIPS, **hardware.LINKS}.items():
        assert entry.source, name
    # Every TPU chip the planner compiles for has a bf16 peak and an ICI figure for its roofline.
    for chip, spec in hardware.CHIPS.items():
        assert spec.peak_flops["bfloat16"] > 0 and f"{chip}-ici" in hardware.LINKS, chip
    assert chips_of("v5p:8x8x16") == ("v5p", 1024)
    assert chips_of("v5e:2x2", num_slices=3) == ("v5e", 12)
    assert chips_of("h100:16x8") == ("h100", 128)
