"""`python -m hcjax.bench.serve_load` end to end on a small server: a flooding host at its share,
a light client, the Health probe and a learner's weight pushes, each in a process of its own
(the mixed case's requests and summary alone: its own server would add 40 s to the suite). What
it checks is what the bench reports, not its timings: no host held more than its share, what
the flood's share had no room for waited in its line (or was refused naming the share), Health
and every push answered.
"""

import pytest

from hcjax.bench.serve_load import LARGE, mixed_requests, run_size, summarise_mixed


@pytest.mark.slow
def test_serve_load_holds_every_share_and_answers_health(tmp_path):
    # 4 slots + a queue of 4 samples of 256 tokens: a host's share (1024 tokens) holds one
    # n=16 x 40-token request (640), so two of the three streams wait again and again.
    result = run_size(4, light_requests=3, flood_streams=3, flood_hosts=1, flood_seconds=4.0,
                      push_every=1.0, gin_params=[], out_dir=tmp_path,
                      serve_args=["--max_queue", "4"], log=lambda m: None)
    assert result["over_share"] == []
    share = result["host_share"]
    flood_host = result["held_max"]["ipv4:127.0.0.2"]
    assert 0 < flood_host["work"] <= share["work"] and flood_host["requests"] <= share["requests"]
    [host] = result["flood"]["hosts"]
    assert host["ok"] > 0 and host["other_errors"] == 0
    # what its share had no room for waited in its line (up to 2 s), or was refused naming it
    assert result["line_max"]["ipv4:127.0.0.2"] > 0
    assert all("over its share of" in refusal for refusal in host["refusals"])
    assert result["light_under_flood"]["n"] == 3 and result["light_alone"]["n"] == 3
    assert result["health"]["n"] > 0 and result["health"]["errors"] == 0
    assert result["pushes"]["n"] > 0 and result["pushes"]["errors"] == []
    assert result["memory_under_load"]["rss_mb"] > 0


def test_the_mixed_case_is_valid_and_summarised():
    requests = mixed_requests(256, 8)
    large = [r for r in requests if r.n == LARGE["n"]]
    assert len(requests) == 256 and len(large) == 8
    assert all(len(r.prompt) == 32 and r.max_tokens == 32 for r in large)
    # every one fits the mixed server (max_n 16, max_target_length 64) and is its own message
    assert all(r.n <= 16 and len(r.prompt) + r.max_tokens <= 64 for r in requests)
    assert len({r.seed for r in requests}) == 256
    assert max(r.n * (len(r.prompt) + r.max_tokens) for r in requests if r.n != 16) == 512
    rows = [{"kind": "large", "answered": True, "seconds": s, "refusals": k, "hints": k,
             "error": None} for s, k in ((1.0, 0), (3.0, 2))]
    rows.append({"kind": "small", "answered": False, "refusals": 30, "hints": 30,
                 "error": None})
    summary = summarise_mixed(rows)
    assert (summary["answered"], summary["large_answered"]) == (2, 2)
    assert summary["large"]["p50_ms"] == 2000.0 and summary["small"] == {"n": 0}
    assert (summary["max_refusals"], summary["max_refusals_large"]) == (30, 2)

