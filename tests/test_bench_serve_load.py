"""`python -m hcjax.bench.serve_load` end to end on a small server: a flooding host at its share,
a light client, the Health probe and a learner's weight pushes, each in a process of its own.
What it checks is what the bench reports, not its timings: no host held more than its share,
the flood was refused with RESOURCE_EXHAUSTED naming the share, Health and every push answered.
"""

import pytest

from hcjax.bench.serve_load import run_size


@pytest.mark.slow
def test_serve_load_holds_every_share_and_answers_health(tmp_path):
    # 4 slots + a queue of 4 samples of 256 tokens: a host's share (1024 tokens) holds one
    # n=16 x 40-token request (640), so three streams are refused at once and again.
    result = run_size(4, light_requests=3, flood_streams=3, flood_hosts=1, flood_seconds=4.0,
                      push_every=1.0, gin_params=[], out_dir=tmp_path,
                      serve_args=["--max_queue", "4"], log=lambda m: None)
    assert result["over_share"] == []
    share = result["host_share"]
    flood_host = result["held_max"]["ipv4:127.0.0.2"]
    assert 0 < flood_host["work"] <= share["work"] and flood_host["requests"] <= share["requests"]
    [host] = result["flood"]["hosts"]
    assert host["ok"] > 0 and host["resource_exhausted"] > 0 and host["other_errors"] == 0
    assert "over its share of" in host["refusals"][0]
    assert result["light_under_flood"]["n"] == 3 and result["light_alone"]["n"] == 3
    assert result["health"]["n"] > 0 and result["health"]["errors"] == 0
    assert result["pushes"]["n"] > 0 and result["pushes"]["errors"] == []
    assert result["memory_under_load"]["rss_mb"] > 0
