"""The pass@1 helper: cached greedy generation of right-padded prompts agrees with the full
forward pass, stops at the stop token, and scoring compares each answer with its problem's
reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hcjax.data.problem import TaskProblem
from hcjax.data.template import encode_content
from hcjax.data.tokenizer import ByteTokenizer
from hcjax.eval import evaluate_problems, generate
from hcjax.model import ModelConfig, Transformer

TINY = ModelConfig(
    vocab_size=272, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
    attention_pattern=("local", "global"), window=4, ffn_pattern=("moe", "dense"), d_ff=64,
    num_experts=4, experts_per_token=2, moe_latent_dim=16, moe_d_ff=32, dtype="float32",
    max_seq_len=64,
)


@pytest.fixture(scope="module")
def model():
    return Transformer(TINY, rngs=nnx.Rngs(3))


def test_greedy_generation_matches_full_forward(model):
    prompts = [[1, 20, 30, 40, 50, 60, 70], [1, 25], [1, 33, 44, 55]]  # different lengths
    outs = generate(model, prompts, max_new_tokens=6, stop=[999])  # no stop: 6 tokens each
    assert [len(o) for o in outs] == [6, 6, 6]
    for p, o in zip(prompts, outs, strict=True):
        seq = jnp.asarray([p + o], jnp.int32)
        logits = model(seq).logits[0]
        greedy = np.asarray(jnp.argmax(logits, axis=-1))
        np.testing.assert_array_equal(greedy[len(p) - 1 : len(p) + 5], o)


def test_stop_token_ends_a_row(model):
    prompts = [[1, 20, 30], [1, 40]]
    free = generate(model, prompts, max_new_tokens=5, stop=[999])
    stop = free[0][1]  # a token row 0 generates becomes a stop token
    outs = generate(model, prompts, max_new_tokens=5, stop=[stop])
    for got, full in zip(outs, free, strict=True):
        cut = full.index(stop) + 1 if stop in full else 5
        assert got == full[:cut]
    assert len(outs[0]) <= 2


def test_sampling_is_seeded(model):
    prompts = [[1, 20, 30]] * 4
    a = generate(model, prompts, 5, stop=[999], temperature=1.0, seed=7)
    b = generate(model, prompts, 5, stop=[999], temperature=1.0, seed=7)
    assert a == b
    assert len({tuple(x) for x in a}) > 1  # rows draw different samples


def _problem(pid, prompt, answer, difficulty):
    return TaskProblem(pid, "add", ({"role": "user", "content": prompt},), reference=answer,
                       meta={"kind": "add", "difficulty": difficulty})


def test_evaluate_scores_against_each_reference(model, monkeypatch):
    import hcjax.eval

    problems = [_problem("a", "1+1=", "2", 1), _problem("b", "2+2=", "4", 2)]
    res = evaluate_problems(model, problems, max_new_tokens=4)
    # The random model never writes a complete <answer> block: nothing passes, nothing formatted.
    assert res.pass_at_1 == 0.0 and res.format_rate == 0.0
    # Every row answers 2 (in our template): right for a, wrong for b.
    tok = ByteTokenizer()
    answer = encode_content("<think></think><answer>2</answer>", tok) + [tok.eos_id]
    monkeypatch.setattr(hcjax.eval, "generate", lambda m, prompts, *a, **k: [answer] * len(prompts))
    res = evaluate_problems(model, problems, max_new_tokens=4)
    assert res.pass_at_1 == 0.5 and res.by_difficulty == {1: 1.0, 2: 0.0}
    assert res.format_rate == 1.0
    s = res.summary()
    assert s["pass_at_1_add"] == 0.5 and len(s["examples"]) == 2
    assert s["examples"][1]["answer"] == "4"


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="temperature=-1"):
        generate(model, [[1]], 4, stop=[2], temperature=-1)
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        generate(model, [[1] * 60], 8, stop=[2])
    with pytest.raises(ValueError, match="empty"):
        evaluate_problems(model, [])
