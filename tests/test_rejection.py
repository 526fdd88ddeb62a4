"""Shortest rejection sampling: the selection exactly, and a tiny sampling smoke that writes a chat
JSONL set the SFT pipeline reads."""

import json

import pytest
from flax import nnx

from hcjax.distill.rejection import (
    Sample,
    rejection_conversations,
    run_rejection,
    shortest_correct,
)
from hcjax.model_io import write_checkpoint
from hcjax.tasks.base import TaskProblem


def test_shortest_correct_exact():
    s = [Sample("a", 9, True), Sample("b", 3, False), Sample("c", 5, True), Sample("d", 5, True)]
    assert shortest_correct(s) == 2  # the shortest correct, first of equals; wrong ones ignored
    assert shortest_correct([Sample("x", 1, False)]) is None
    assert shortest_correct([]) is None


def test_rejection_conversations_keep_one_per_solved_problem():
    problems = [TaskProblem(f"p{i}", "c", ({"role": "user", "content": f"q{i}"},))
                for i in range(3)]
    samples = [[Sample("long", 8, True), Sample("short", 4, True)],
               [Sample("wrong", 2, False)],
               [Sample("only", 6, True)]]
    assert rejection_conversations(problems, samples) == [
        [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "short"}],
        [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "only"}],
    ]


def test_rejection_sampling_smoke(tmp_path):
    from hcjax.model import ModelConfig, create_sharded
    from hcjax.sharding import MeshConfig, make_mesh
    from hcjax.tasks import ArithmeticSuite

    cfg = ModelConfig(vocab_size=272, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=8, d_ff=32, num_experts=2, experts_per_token=1,
                      moe_latent_dim=8, moe_d_ff=16, max_seq_len=64, dtype="float32")
    model = create_sharded(cfg, make_mesh(MeshConfig(num_devices=1)))
    write_checkpoint(str(tmp_path / "m"), nnx.to_pure_dict(nnx.state(model, nnx.Param)), cfg)
    suite = ArithmeticSuite(kinds=("add",), max_digits=1, num_heldout=4)
    s = run_rejection(str(tmp_path / "m"), str(tmp_path / "out"), suite, k=3, num_problems=4,
                      max_new_tokens=8)
    assert s["problems"] == 4 and s["k"] == 3 and 0 <= s["kept"] <= 4
    assert 1 <= s["mean_sample_length"] <= 8
    lines = (tmp_path / "out" / "rejection.jsonl").read_text().splitlines()
    assert len(lines) == s["kept"]
    for line in lines:
        assert [m["role"] for m in json.loads(line)["messages"]] == ["user", "assistant"]
    records = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(len(r["samples"]) == 3 for r in records)
    assert {"text", "length", "correct"} == set(records[0]["samples"][0])


def test_long2short_comparison_against_the_reference():
    from hcjax.distill.shortening import compare

    table = compare({"long": {"pass_at_1": 0.50, "mean_length": 20.0},
                     "short": {"pass_at_1": 0.49, "mean_length": 14.0},
                     "worse": {"pass_at_1": 0.40, "mean_length": 10.0},
                     "barely": {"pass_at_1": 0.60, "mean_length": 16.0}})
    assert table["short"]["length_cut"] == pytest.approx(0.3)
    assert table["short"]["pass_at_1_delta"] == pytest.approx(-0.01)
    assert [n for n, r in table.items() if r["passes"]] == ["short"]
