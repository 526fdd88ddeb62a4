"""The one generate path and the one pass@1 evaluator: greedy generation through the engine and
server equals the full forward pass's argmax (prompts of different lengths, stop tokens kept),
sampling is seeded, and pass@1 grades each problem by its suite through any inference client
(hand-counted figures overall, per category, per suite, per extraction, format and length)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hcjax.data.problem import TaskProblem
from hcjax.data.template import stop_ids
from hcjax.data.tokenizer import ByteTokenizer
from hcjax.model import ModelConfig, Transformer, add_weight_noise
from hcjax.rl.pass_at_1 import (
    EVAL_PRIORITY,
    ModelEvaluator,
    PassAt1,
    evaluate_model,
    greedy,
    summarize,
)
from hcjax.rl.sources import TaskBuilder
from hcjax.rollout import Engine, SampledRollout, SamplingOptions, generate
from hcjax.tasks import ArithmeticSuite, MixtureSuite

# The engines here test serving, not the sampler: its sort-only setting (bit-identical draws,
# a third of the compile; tests/conftest.py).
pytestmark = pytest.mark.usefixtures("sort_only_sampler")

TINY = ModelConfig(
    vocab_size=272, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
    attention_pattern=("local", "global"), window=4, ffn_pattern=("moe", "dense"), d_ff=64,
    num_experts=4, experts_per_token=2, moe_latent_dim=16, moe_d_ff=32, dtype="float32",
    max_seq_len=64,
)
TOK = ByteTokenizer()
GREEDY6 = SamplingOptions(max_tokens=6, temperature=0.0, top_p=1.0)


@pytest.fixture(scope="module")
def model():
    return Transformer(TINY, rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def engine(model):
    """One engine for the generate tests: its functions compile once."""
    return Engine(model, max_concurrent_decodes=4, max_prefill_length=16, max_target_length=64)


def _tokens(records):
    return [r.response_ids.tolist() for r in records]


def test_greedy_generation_matches_full_forward(model, engine):
    prompts = [[1, 20, 30, 40, 50, 60, 70], [1, 25], [1, 33, 44, 55]]  # different lengths
    outs = _tokens(generate(model, prompts, GREEDY6, engine=engine))  # no stop token: 6 tokens each
    assert [len(o) for o in outs] == [6, 6, 6]
    for p, o in zip(prompts, outs, strict=True):
        seq = jnp.asarray([p + o], jnp.int32)
        logits = model(seq).logits[0]
        greedy_ids = np.asarray(jnp.argmax(logits, axis=-1))
        np.testing.assert_array_equal(greedy_ids[len(p) - 1 : len(p) + 5], o)


def test_stop_token_ends_a_row_and_is_kept(model, engine):
    prompts = [[1, 20, 30], [1, 40]]
    free = _tokens(generate(model, prompts, GREEDY6, engine=engine))
    stop = free[0][1]  # a token row 0 generates becomes a stop token
    records = generate(model, prompts, dataclasses.replace(GREEDY6, stop_tokens=(stop,)),
                       engine=engine)
    for rec, full in zip(records, free, strict=True):
        cut = full.index(stop) + 1 if stop in full else 6
        assert rec.response_ids.tolist() == full[:cut]
        assert rec.finish_reason == ("stop" if stop in full else "length")
    assert records[0].response_len <= 2


def test_sampling_is_seeded(model, engine):
    options = SamplingOptions(max_tokens=5, temperature=1.0, top_p=1.0, seed=7)
    a = _tokens(generate(model, [[1, 20, 30]], options, n=4, engine=engine))
    b = _tokens(generate(model, [[1, 20, 30]], options, n=4, engine=engine))
    assert a == b
    assert len({tuple(x) for x in a}) > 1  # the samples of a prompt differ


class ScriptedClient:
    """Answers sample i of every request with `answers[i]` (our template), ending in the
    request's first stop token; records the requests."""

    def __init__(self, answers):
        self.answers = answers
        self.requests = []

    def generate(self, request, timeout=None):
        self.requests.append(request)
        out = []
        for i in range(request.n):
            ids = TOK.encode(self.answers[i]) + [request.stop_tokens[0]]
            n = len(ids)
            out.append(SampledRollout(
                prompt_ids=np.asarray(request.prompt), response_ids=np.asarray(ids),
                logprobs=np.zeros(n), n_kept=np.ones(n), threshold_logit=np.zeros(n),
                loss_mask=np.ones(n, bool), versions=np.zeros(n), finish_reason="stop",
                sample_index=i, temperature=request.temperature,
                max_tokens=request.max_tokens, stop_tokens=request.stop_tokens))
        return out


def _problem(pid, prompt, answer, category):
    return TaskProblem(pid, category, ({"role": "user", "content": prompt},), reference=answer)


PROBLEMS = [_problem("a", "1+1=", "2", "add:1x1"), _problem("b", "2+2=", "4", "add:1x1"),
            _problem("c", "3+3=", "6", "add:2x1")]
OPTIONS = SamplingOptions(max_tokens=16, stop_tokens=stop_ids(TOK))


def test_pass_at_1_grades_each_problem_by_its_suite():
    # Every answer is 2: right for a only. "2" alone has no <answer> block: strict misses it,
    # flexible (the last number) finds it.
    client = ScriptedClient(["<think></think><answer>2</answer>"])
    builder = TaskBuilder(ArithmeticSuite(), TOK)
    s = PassAt1(client, builder, PROBLEMS, greedy(OPTIONS)).evaluate()
    assert s["pass_at_1"] == pytest.approx(1 / 3) and s["problems"] == 3 and s["samples"] == 1
    assert s["by_category"] == {"add:1x1": 0.5, "add:2x1": 0.0}
    assert s["category_sizes"] == {"add:1x1": 2, "add:2x1": 1}
    # One suite: its name is the only "by suite" entry, the whole figure.
    assert s["by_suite"] == {"arithmetic": pytest.approx(1 / 3)}
    assert s["suite_sizes"] == {"arithmetic": 3}
    assert s["extraction"] == {"strict": pytest.approx(1 / 3), "flexible": pytest.approx(1 / 3)}
    assert s["format_rate"] == 1.0 and s["aborted"] == 0
    assert s["mean_length"] == len(TOK.encode("<think></think><answer>2</answer>")) + 1
    assert [e["id"] for e in s["examples"]] == ["a", "b", "c"]
    assert s["examples"][0]["correct"] and not s["examples"][1]["correct"]
    # The requests are the evaluation's: greedy, whole responses, EVAL_PRIORITY, one sample.
    assert all(r.temperature == 0.0 and r.top_p == 1.0 and r.token_budget is None
               and r.priority == EVAL_PRIORITY and r.n == 1 and r.max_tokens == 16
               for r in client.requests)
    unformatted = PassAt1(ScriptedClient(["2"]), builder, PROBLEMS, greedy(OPTIONS)).evaluate()
    assert unformatted["pass_at_1"] == 0.0 and unformatted["format_rate"] == 0.0
    assert unformatted["extraction"] == {"strict": 0.0, "flexible": pytest.approx(1 / 3)}


def test_pass_at_1_of_k_samples_per_problem_and_per_suite():
    # Sample 0 answers 2, sample 1 answers 4: a and b each have one right sample of two.
    client = ScriptedClient(["<answer>2</answer>", "<answer>4</answer>"])
    mix = MixtureSuite(suites=(ArithmeticSuite(),))
    problems = [dataclasses.replace(p, id=f"arithmetic/{p.id}", category=f"arithmetic/{p.category}")
                for p in PROBLEMS]
    sampled = dataclasses.replace(OPTIONS, temperature=1.0)
    s = PassAt1(client, TaskBuilder(mix, TOK), problems, sampled, k=2, seed=5).evaluate()
    assert s["pass_at_1"] == pytest.approx((0.5 + 0.5 + 0.0) / 3) and s["samples"] == 2
    assert s["by_suite"] == {"arithmetic": pytest.approx(1 / 3)}
    assert [r.n for r in client.requests] == [2, 2, 2]
    assert len({r.seed for r in client.requests}) == 3  # each problem its own key stream
    with pytest.raises(ValueError, match="k=2 must be 1 when greedy"):
        PassAt1(client, TaskBuilder(mix, TOK), problems, greedy(OPTIONS), k=2)


def test_pass_at_1_by_member_suite_of_a_mixture():
    # Every answer is 2: right for a only. a and b belong to "arithmetic", c to "arith2".
    mix = MixtureSuite(suites=(ArithmeticSuite(), ArithmeticSuite(name="arith2")))
    owners = {"a": "arithmetic", "b": "arithmetic", "c": "arith2"}
    problems = [dataclasses.replace(p, id=f"{owners[p.id]}/{p.id}",
                                    category=f"{owners[p.id]}/{p.category}",
                                    meta={"suite": owners[p.id]}) for p in PROBLEMS]
    client = ScriptedClient(["<think></think><answer>2</answer>"])
    s = PassAt1(client, TaskBuilder(mix, TOK), problems, greedy(OPTIONS)).evaluate()
    assert s["by_suite"] == {"arith2": 0.0, "arithmetic": 0.5}
    assert s["suite_sizes"] == {"arith2": 1, "arithmetic": 2}
    assert s["by_category"] == {"arith2/add:2x1": 0.0, "arithmetic/add:1x1": 0.5}


def _check_greedy(model, builder, problems, groups, max_tokens):
    """Each sample is the greedy continuation of the climb's prompt: the full forward's argmax
    at every position, up to a stop token."""
    for p, [rec] in zip(problems, groups, strict=True):
        prompt, out = list(builder.prompt_ids(p)), rec.response_ids.tolist()
        assert rec.prompt_ids.tolist() == prompt and rec.temperature == 0.0
        logits = model(jnp.asarray([prompt + out], jnp.int32)).logits[0]
        want = np.asarray(jnp.argmax(logits, axis=-1))[len(prompt) - 1 : len(prompt) + len(out) - 1]
        np.testing.assert_array_equal(want, out)
        assert len(out) == max_tokens or out[-1] in stop_ids(TOK)


def test_a_model_is_evaluated_on_the_climbs_path(model):
    suite = ArithmeticSuite(kinds=("add",), max_digits=1, num_heldout=4)
    problems, builder = suite.heldout(), TaskBuilder(suite, TOK)
    evaluations = ModelEvaluator(max_tokens=4, max_concurrent_decodes=4)
    with evaluations.serving(model, suite, problems) as evaluator:
        groups = evaluator.samples()
    s = summarize(problems, groups, TOK)
    # The random model never writes a complete <answer> block: nothing passes, nothing formatted.
    assert s["pass_at_1"] == 0.0 and s["format_rate"] == 0.0 and s["problems"] == 4
    assert 1 <= s["mean_length"] <= 4
    _check_greedy(model, builder, problems, groups, 4)
    # Another model of the same config is served on the same engine (compiled once), with its
    # own weights; a model of another config needs an engine of its own.
    [engine] = evaluations._engines
    other = Transformer(TINY, rngs=nnx.Rngs(3))
    nnx.update(other, add_weight_noise(nnx.state(other), 1))
    with evaluations.serving(other, suite, problems) as evaluator:
        theirs = evaluator.samples()
    assert evaluations._engines == [engine]
    assert _tokens(g[0] for g in theirs) != _tokens(g[0] for g in groups)
    _check_greedy(other, builder, problems, theirs, 4)
    wider = Transformer(dataclasses.replace(TINY, window=8), rngs=nnx.Rngs(3))
    assert not engine.serves(wider)
    with pytest.raises(ValueError, match="built for another model"):
        generate(wider, [[1, 2]], GREEDY6, engine=engine)


def test_bad_arguments_and_no_problems(model):
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingOptions(temperature=-1)
    suite = ArithmeticSuite(kinds=("add",), max_digits=1, num_heldout=4)
    with pytest.raises(ValueError, match="exceeds"):
        evaluate_model(model, suite, suite.heldout(), max_tokens=60)
    empty = summarize([], [], TOK)
    assert empty["problems"] == 0 and np.isnan(empty["pass_at_1"])
    with pytest.raises(ValueError, match="3 problems but 1 sample lists"):
        summarize(PROBLEMS, [[]], TOK)
