"""The tool-use suite: the calc tool's safe evaluation, determinism and held-out disjointness,
token-faithful targets replayed through the ReAct loop, grading, and lengths."""

import pytest

from hcjax.data import tokenizer as T
from hcjax.data.template import encode_content, encode_prompt_response, prompt_ids
from hcjax.data.tokenizer import ByteTokenizer
from hcjax.envs import react
from hcjax.envs.tools import ToolCall, parse_tool_calls
from hcjax.tasks.base import TaskSuite, check_suite
from hcjax.tasks.tool_use import (
    ToolUseSuite,
    calc_tool,
    encode_response,
    safe_calc,
    sft_example,
    tool_call_text,
)

TOK = ByteTokenizer()
END = TOK.special_id(T.END_TURN)


def test_is_a_task_suite_with_documented_format():
    suite = ToolUseSuite()
    check_suite(suite)
    assert isinstance(suite, TaskSuite)
    assert suite.name == "tool_use"
    assert suite.categories() == ["mul:2x2", "mul:3x2"]
    assert suite.budget == react.Budget(max_steps=2, max_context=256, max_time_s=60.0)
    p = suite.train_problem(0)
    a, b = p.meta["a"], p.meta["b"]
    assert p.messages == ({"role": "user", "content": f"calc {a}*{b}"},)
    assert p.reference == str(a * b)
    assert p.target == (
        f'<tool_call>{{"name":"calc","arguments":{{"expr":"{a}*{b}"}}}}</tool_call><|end|>'
        f"\n<tool_result>\n{a * b}\n</tool_result>\n<answer>{a * b}</answer>")
    assert parse_tool_calls(tool_call_text("12*34")) == [ToolCall("calc", {"expr": "12*34"})]


def test_safe_calc():
    assert safe_calc("123*45") == 5535
    assert safe_calc("2+3*4-5") == 9
    assert safe_calc(" 10 - 2 * 3 * 1 + 7 ") == 11
    assert safe_calc("0*9") == 0
    for bad in ["__import__('os')", "2**10", "1/2", "-3", "3-", "", "(1+2)", "1e9", "1_000",
                "2*" * 40 + "2", "٣*2", "1\t+2", "1;2", "x"]:
        with pytest.raises(ValueError, match="expr must be"):
            safe_calc(bad)


def test_calc_tool_through_the_tool_set():
    tools = ToolUseSuite().tools(ToolUseSuite().train_problem(0))
    ok = tools(ToolCall("calc", {"expr": "123*45"}))
    assert ok.ok and ok.output == "5535" and not ok.aborted
    unsafe = tools(ToolCall("calc", {"expr": "__import__('os').system('id')"}))
    assert not unsafe.ok and unsafe.output.startswith("error: expr must be")
    assert "import" not in unsafe.output  # the expression is never echoed back
    assert tools(ToolCall("calc", {"expr": 5})).malformed
    assert tools(ToolCall("calc", {"x": "1+1"})).malformed
    assert tools(ToolCall("python", {"expr": "1"})).malformed
    assert calc_tool().name == "calc"


def test_deterministic_and_seeded():
    a, b = ToolUseSuite(seed=1), ToolUseSuite(seed=1)
    assert a.heldout() == b.heldout()
    assert [a.train_problem(i) for i in range(20)] == [b.train_problem(i) for i in range(20)]
    assert ToolUseSuite(seed=2).heldout() != a.heldout()


def test_heldout_disjoint_from_train():
    suite = ToolUseSuite(min_digits=1, max_digits=1, other_digits=1, num_heldout=30)
    held = {(p.meta["a"], p.meta["b"]) for p in suite.heldout()}
    train = {(p.meta["a"], p.meta["b"]) for p in (suite.train_problem(i) for i in range(2000))}
    assert not held & train
    assert len(train) == 100 - len(held)  # every other product of two digits stays in training
    big = ToolUseSuite()
    held = {p.prompt for p in big.heldout()}
    assert not held & {big.train_problem(i).prompt for i in range(2000)}
    assert {p.category for p in big.heldout()} == {"mul:2x2", "mul:3x2"}


def test_heldout_min_digits_holds_out_the_longer_factors_only():
    suite = ToolUseSuite(min_digits=2, max_digits=5, heldout_min_digits=4, num_heldout=200)
    held = suite.heldout()
    assert len(held) == 200 and {p.category for p in held} == {"mul:4x2", "mul:5x2"}
    assert all(len(str(p.meta["a"])) >= 4 for p in held)
    train = [suite.train_problem(i) for i in range(400)]
    assert {p.category for p in train} == set(suite.categories())  # training keeps every length
    assert not {(p.meta["a"], p.meta["b"]) for p in held} & {
        (p.meta["a"], p.meta["b"]) for p in train}
    # The training stream's draws do not depend on the knob (only which of them are redrawn as
    # held-out collisions does).
    plain = ToolUseSuite(min_digits=2, max_digits=5, num_heldout=200)
    assert all(suite._problem("train", i) == plain._problem("train", i) for i in range(50))
    # Four- and five-digit factors: a call of at most 71 tokens (the mixed climb's max_tokens 72).
    assert max(encode_response(p.target, TOK)[1].index(0) for p in held) == 71


@pytest.mark.parametrize("kwargs, match", [
    ({"heldout_min_digits": 4}, "heldout_min_digits=4"),
    ({"heldout_min_digits": 1}, "heldout_min_digits=1"),
    ({"min_digits": 0}, "min_digits=0"),
    ({"min_digits": 3, "max_digits": 2}, "max_digits=2"),
    ({"other_digits": 0}, "other_digits=0"),
    ({"num_heldout": -1}, "num_heldout=-1"),
    ({"budget": 4}, "budget=4"),
])
def test_bad_config_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ToolUseSuite(**kwargs)


def _scripted_policy(problem, seen):
    """Plays the target's turns, each ending in the stop token the engine keeps."""
    turn1, rest = problem.target.split(T.END_TURN)
    turn2 = rest.rsplit("\n</tool_result>\n", 1)[1]
    turns = [encode_content(turn1, TOK) + [END], encode_content(turn2, TOK) + [END]]

    def policy(ids):
        seen.append(list(ids))
        return turns[len(seen) - 1]

    return policy


def test_target_replays_token_faithfully_through_the_react_loop():
    suite = ToolUseSuite(num_heldout=20)
    longest_second_prompt = 0
    for p in suite.heldout():
        seen = []
        start = prompt_ids(p.prompt, TOK)
        traj = react.run_episode(start, _scripted_policy(p, seen), TOK, suite.tools(p),
                                 suite.budget)
        assert traj.finish_reason == react.STOP
        assert (traj.num_tool_calls, traj.num_successful, traj.num_malformed) == (1, 1, 0)
        # What holds exactly: the episode's response ids are encode_response(target) plus the
        # final turn's <|end|>, with the same loss mask; decoded, they are target + "<|end|>".
        ids, mask = encode_response(p.target, TOK)
        assert traj.response_ids == ids + [END]
        assert traj.loss_mask == mask + [1]
        text = TOK.decode(traj.response_ids)
        assert text == p.target + T.END_TURN
        g = suite.grade(p, text)
        assert g.correct and g.reward == 1.0
        assert g.components == {"correct": 1.0, "tool_calls": 1.0}
        # The SFT document is the episode itself, closed like a single-turn conversation.
        doc, doc_mask = sft_example(p, TOK)
        assert doc == start + traj.response_ids + [TOK.eos_id]
        assert doc_mask == [0] * len(start) + traj.loss_mask + [0]
        longest_second_prompt = max(longest_second_prompt, len(seen[1]))
    assert longest_second_prompt <= 128


def test_sft_example_closes_like_the_single_turn_template():
    p = ToolUseSuite().train_problem(3)
    answer = p.target.rsplit("\n</tool_result>\n", 1)[1]  # "<answer>N</answer>"
    ids, mask = encode_prompt_response(p.prompt, answer, TOK)
    n = len(prompt_ids(p.prompt, TOK))
    doc, doc_mask = sft_example(p, TOK)
    assert doc[:n] == ids[:n] and doc_mask[:n] == mask[:n]  # the same prompt
    assert doc[-(len(ids) - n):] == ids[n:] and doc_mask[-(len(ids) - n):] == mask[n:]


def test_grade():
    suite = ToolUseSuite()
    p = suite.train_problem(0)
    right, wrong = p.reference, str(int(p.reference) + 1)
    direct = suite.grade(p, f"<answer>{right}</answer><|end|>")
    assert direct.correct and direct.components == {"correct": 1.0, "tool_calls": 0.0}
    bad = suite.grade(p, p.target.replace(f"<answer>{right}</answer>", f"<answer>{wrong}</answer>"))
    assert bad.reward == 0.0 and not bad.correct and not bad.aborted
    assert "differs from" in bad.reason and bad.components["tool_calls"] == 1.0
    none = suite.grade(p, tool_call_text("1*2"))
    assert none.reward == 0.0 and "no <answer> block" in none.reason
    # The last answer counts.
    assert suite.grade(p, f"<answer>{wrong}</answer><answer>{right}</answer>").correct
    assert not suite.grade(p, f"<answer>{right}</answer><answer>{wrong}</answer>").correct


def test_a_turn_without_a_call_ends_the_episode_and_grades():
    suite = ToolUseSuite()
    p = suite.train_problem(5)
    answer = encode_content(f"<answer>{p.reference}</answer>", TOK) + [END]
    traj = react.run_episode(prompt_ids(p.prompt, TOK), lambda ids: answer, TOK, suite.tools(p),
                             suite.budget)
    assert traj.finish_reason == react.STOP and traj.num_tool_calls == 0
    assert suite.grade(p, TOK.decode(traj.response_ids)).correct


def test_lengths_fit_the_tiny_context():
    suite = ToolUseSuite()
    problems = [*suite.heldout(), *(suite.train_problem(i) for i in range(1000))]
    assert max(len(prompt_ids(p.prompt, TOK)) for p in problems) <= 32
    first_turn, answer_turn, episode = 0, 0, 0
    for p in problems:
        ids, mask = encode_response(p.target, TOK)
        first = mask.index(0)  # turn 1 (with its <|end|>) ends where the observation starts
        first_turn = max(first_turn, first)
        answer_turn = max(answer_turn, sum(mask) - first + 1)  # + the final <|end|>
        episode = max(episode, len(prompt_ids(p.prompt, TOK)) + len(ids) + 1)
    assert first_turn == 69  # the fixed call format: 11 + 45 + 12 bytes and <|end|>
    assert answer_turn <= 8
    assert episode <= 128 <= suite.budget.max_context
