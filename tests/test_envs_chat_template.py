"""Token-in / token-out agent episodes under the real Qwen3 and Llama 3.1 chat templates
(tests/fixtures/templates, verbatim): the renderer runs them, observations are the template's
tool-message tokens appended to the exact sampled turns, template drift is counted (never
substituted), and the learner's rows hold exactly the sampled tokens."""

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from hcjax.data.hf_tokenizer import ChatTemplateError, HFTokenizer
from hcjax.envs import react
from hcjax.envs.tools import Tool, ToolResult, ToolSet
from hcjax.rl.batch import pack_rollouts
from hcjax.rl.report import step_record, write_report
from hcjax.rl.workers import RolloutWorker, Task, WorkerStats
from hcjax.rollout.request import SampledRollout, SamplingOptions

TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "templates"
FIXTURES = Path(
    os.environ.get("HCJAX_HF_FIXTURES", Path(__file__).resolve().parents[2] / "shared/fixtures/hf")
)
if not FIXTURES.is_dir():
    pytest.skip(f"Hugging Face fixtures not found at {FIXTURES}", allow_module_level=True)

QUESTION = [{"role": "system", "content": "sys"}, {"role": "user", "content": "what is 2+3?"}]
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>'
# Qwen3's tool-message wrapping after an assistant turn's <|im_end|>, and the next header.
QWEN_TOOL = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def tokenizer_with(template: str, tmp_path: Path) -> HFTokenizer:
    """The qwen3 fixture's tiny tokenizer (specials <|endoftext|> <|im_start|> <|im_end|>) with
    a real chat template; other markers (<think>, <|eot_id|>) are ordinary text pieces."""
    folder = tmp_path / template
    folder.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(FIXTURES / "qwen3" / f, folder / f)
    shutil.copy(TEMPLATES / f"{template}.jinja", folder / "chat_template.jinja")
    return HFTokenizer.from_pretrained(folder)


@pytest.fixture()
def qwen3(tmp_path):
    return tokenizer_with("qwen3", tmp_path)


@pytest.fixture()
def llama(tmp_path):
    return tokenizer_with("llama3_1", tmp_path)


def calc_tools():
    return ToolSet([Tool("calc", "integer arithmetic", {"expr": str},
                         lambda expr: ToolResult(str(sum(int(x) for x in expr.split("+")))))])


class Scripted:
    """Replays fixed turns as token ids (encoded once, never re-encoded), recording what it saw."""

    def __init__(self, tok, turns, eos=()):
        self.ids = [tok.encode(t) + list(eos) for t in turns]
        self.sampled = [list(i) for i in self.ids]
        self.seen = []

    def __call__(self, token_ids):
        self.seen.append(list(token_ids))
        return self.ids.pop(0)


# ---- the stored templates ----


def test_templates_are_the_published_files():
    """Byte-identical to the copies named in tests/fixtures/templates/README.md."""
    readme = (TEMPLATES / "README.md").read_text()
    for name in ("qwen3.jinja", "llama3_1.jinja"):
        digest = hashlib.sha256((TEMPLATES / name).read_bytes()).hexdigest()
        assert f"`{name}` sha256 `{digest}`" in readme, name


def test_renderer_runs_the_real_qwen3_template(qwen3):
    """namespace, [::-1], startswith/split/rstrip/lstrip/strip, tojson, loop.index0: earlier
    queries' assistant turns lose their <think> block, the current query's keep it."""
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nold thought\n</think>\n\nA1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>t2</think>" + CALL},
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "6"},
        {"role": "assistant", "content": "<think>\nlast\n</think>\n\nA2"},
    ]
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"x": "é<>"}}}]
    text = qwen3.render_chat_template(msgs, add_generation_prompt=False, tools=tools)
    assert text.startswith("<|im_start|>system\n# Tools\n\n")
    assert '\n{"type": "function", "function": {"name": "calc", "parameters": {"x": "é<>"}}}\n' \
        in text
    assert text.endswith(
        "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nq2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nt2\n</think>\n\n" + CALL + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nlast\n</think>\n\nA2<|im_end|>\n")
    assert qwen3.render_chat_template(msgs[:1], enable_thinking=False) == (
        "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # `reasoning_content` wins over a think block in the content.
    assert "<think>\nR\n</think>\n\nX" in qwen3.render_chat_template(
        [msgs[0], {"role": "assistant", "content": "X", "reasoning_content": "R"}], False)


def test_renderer_runs_the_real_llama31_template(llama):
    msgs = [{"role": "system", "content": " sys "}, {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [
                {"function": {"name": "calc", "arguments": {"expr": "2+3"}}}]},
            {"role": "tool", "content": "5"}]
    tools = [{"name": "calc", "parameters": {"expr": "string"}}]
    text = llama.render_chat_template(msgs, tools=tools, date_string="01 Jan 2026")
    assert text == (
        "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 01 Jan 2026\n\nsys<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please "
        "respond with a JSON for a function call with its proper arguments that best answers the "
        'given prompt.\n\nRespond in the format {"name": function name, "parameters": dictionary '
        "of argument name and its value}.Do not use variables.\n\n"
        + json.dumps(tools[0], indent=4) + "\n\nhi<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "calc", "parameters": '
        '{"expr": "2+3"}}<|eot_id|>'
        # A string is iterable to Jinja: the template JSON-encodes a tool's text.
        '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    two_calls = dict(msgs[2], tool_calls=msgs[2]["tool_calls"] * 2)
    with pytest.raises(ChatTemplateError, match="only supports single tool-calls"):
        llama.render_chat_template([msgs[1], two_calls])


# ---- token-faithful episodes ----


def test_qwen3_think_episode_is_prompt_plus_sampled_plus_template_deltas(qwen3):
    chat = react.ChatTemplateTurns(qwen3, QUESTION)
    prompt = chat.prompt_ids()
    assert prompt == qwen3.apply_chat_template(QUESTION)
    eos = [qwen3.eos_id]  # the sampled stop token <|im_end|>
    policy = Scripted(qwen3, ["<think>\nadd them\n</think>\n\n" + CALL,
                              "<think>\nso 5\n</think>\n\nThe answer is 5."], eos)
    traj = react.run_episode(prompt, policy, qwen3, calc_tools(), chat=chat)
    delta = qwen3.encode(QWEN_TOOL)
    t1, t2 = policy.sampled
    assert traj.finish_reason == react.STOP and traj.num_successful == 1
    assert traj.response_ids == t1 + delta + t2
    assert traj.loss_mask == [1] * len(t1) + [0] * len(delta) + [1] * len(t2)
    assert policy.seen == [prompt, prompt + t1 + delta]
    assert traj.messages[2:] == [
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n" + CALL},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "<think>\nso 5\n</think>\n\nThe answer is 5."}]
    # Canonical think blocks within one query: the whole re-rendering is these very ids.
    assert traj.template_drift is False and traj.template_drift_at is None
    rendered = qwen3.encode(chat.render(traj.messages, False))
    assert rendered == prompt + traj.response_ids + qwen3.encode("\n")


@pytest.mark.parametrize("case", ["user_feedback", "think_whitespace"])
def test_qwen3_drift_is_counted_not_substituted(qwen3, case):
    """Feedback as a user message: re-rendering drops the first turn's <think> block (it now
    precedes the last user query). A think block without Qwen3's newlines: re-rendering adds
    them. Either way the trajectory keeps the sampled ids and reports where drift starts."""
    role = "user" if case == "user_feedback" else "tool"
    first = ("<think>\nadd them\n</think>\n\n" + CALL if role == "user"
             else "<think>add them</think>" + CALL)
    chat = react.ChatTemplateTurns(qwen3, QUESTION, role=role)
    prompt = chat.prompt_ids()
    policy = Scripted(qwen3, [first, "<think>\nso 5\n</think>\n\nThe answer is 5."],
                      [qwen3.eos_id])
    traj = react.run_episode(prompt, policy, qwen3, calc_tools(), chat=chat)
    delta = (qwen3.encode("\n<|im_start|>user\n5<|im_end|>\n<|im_start|>assistant\n")
             if role == "user" else qwen3.encode(QWEN_TOOL))
    t1, t2 = policy.sampled
    actual = prompt + t1 + delta + t2
    assert traj.response_ids == t1 + delta + t2  # exactly what was sampled, not re-rendered
    assert traj.loss_mask == [1] * len(t1) + [0] * len(delta) + [1] * len(t2)
    rendered = qwen3.encode(chat.render(traj.messages, False))
    assert rendered[: len(actual)] != actual
    at = next(i for i, (a, b) in enumerate(zip(actual, rendered)) if a != b)
    assert traj.template_drift is True and traj.template_drift_at == at
    assert len(prompt) <= at < len(prompt) + len(t1)  # inside the first sampled turn
    text = qwen3.decode(rendered)
    if role == "user":
        assert "add them" not in text and "<think>\nso 5\n</think>" in text
    else:
        assert "<think>\nadd them\n</think>\n\n<tool_call>" in text


def test_an_unclosed_turn_gets_its_end_token_from_the_observation(qwen3):
    chat = react.ChatTemplateTurns(qwen3, QUESTION)
    prompt = chat.prompt_ids()
    # The first turn stopped without <|im_end|> (e.g. at its token limit) after a tool call.
    policy = Scripted(qwen3, ["<think>\nadd\n</think>\n\n" + CALL, "5<|im_end|>"])
    traj = react.run_episode(prompt, policy, qwen3, calc_tools(), chat=chat)
    delta = qwen3.encode("<|im_end|>" + QWEN_TOOL)
    t1, t2 = policy.sampled
    assert traj.response_ids == t1 + delta + t2
    assert traj.loss_mask == [1] * len(t1) + [0] * len(delta) + [1] * len(t2)
    # The first turn re-renders as sampled; the last one, answered without a think block, does
    # not: Qwen3's template gives the last assistant turn an empty one.
    assert traj.template_drift is True
    assert traj.template_drift_at == len(prompt) + len(t1) + len(delta)
    assert "assistant\n<think>\n\n</think>\n\n5<|im_end|>" in chat.render(traj.messages, False)


def test_llama31_tool_episode_without_think(llama):
    # The fixture tokenizer's eos is <|im_end|>; Llama 3.1 ends a turn with <|eot_id|>.
    with pytest.raises(ValueError, match="end_of_turn='<\\|im_end\\|>' is not what the chat"):
        react.ChatTemplateTurns(llama, QUESTION).observation_ids(["5"])
    chat = react.ChatTemplateTurns(llama, QUESTION, end_of_turn="<|eot_id|>")
    prompt = chat.prompt_ids()
    assert llama.decode(prompt).endswith("what is 2+3?<|eot_id|><|start_header_id|>assistant"
                                         "<|end_header_id|>\n\n")
    policy = Scripted(llama, [CALL + "<|eot_id|>", "The answer is 5.<|eot_id|>"])
    traj = react.run_episode(prompt, policy, llama, calc_tools(), chat=chat)
    delta = llama.encode('<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>'
                         "<|start_header_id|>assistant<|end_header_id|>\n\n")
    t1, t2 = policy.sampled
    assert traj.response_ids == t1 + delta + t2
    assert traj.loss_mask == [1] * len(t1) + [0] * len(delta) + [1] * len(t2)
    assert traj.template_drift is False  # Llama 3.1 re-renders plain turns as they were


def test_end_of_turn_is_the_stop_token_the_template_writes(tmp_path):
    tok = tokenizer_with("qwen3", tmp_path)
    gen = Path(tok.name) / "generation_config.json"
    gen.write_text(json.dumps({"eos_token_id": [0, 2]}))  # <|endoftext|>, then <|im_end|>
    tok = HFTokenizer.from_pretrained(tok.name)
    assert tok.eos_id == 0
    assert react.ChatTemplateTurns(tok, QUESTION).end_of_turn == "<|im_end|>"


def test_chat_turns_validation(qwen3):
    with pytest.raises(ValueError, match="role='assistant'"):
        react.ChatTemplateTurns(qwen3, QUESTION, role="assistant")
    with pytest.raises(ValueError, match="end_of_turn=''"):
        react.ChatTemplateTurns(qwen3, QUESTION, end_of_turn="")


# ---- from the episode to the learner's rows ----


class ScriptedClient:
    """One scripted turn per request, with a distinct log-prob per sampled token."""

    def __init__(self, turns):
        self.turns = list(turns)
        self.logprobs = []

    def generate(self, request, timeout=None):
        ids = np.asarray(self.turns.pop(0))
        lp = -np.arange(1, len(ids) + 1, dtype=np.float32) / 100 - len(self.logprobs)
        self.logprobs.append(lp)
        n = len(ids)
        return [SampledRollout(
            prompt_ids=np.asarray(request.prompt), response_ids=ids, logprobs=lp,
            n_kept=np.ones(n), threshold_logit=np.zeros(n), loss_mask=np.ones(n, bool),
            versions=np.full(n, 3), finish_reason="stop", max_tokens=request.max_tokens,
            stop_tokens=request.stop_tokens)]


@pytest.mark.parametrize("role", ["tool", "user"])
def test_learner_rows_hold_exactly_the_sampled_tokens(qwen3, role):
    chat = react.ChatTemplateTurns(qwen3, QUESTION, role=role)
    prompt = chat.prompt_ids()
    t1 = qwen3.encode("<think>\nadd them\n</think>\n\n" + CALL) + [qwen3.eos_id]
    t2 = qwen3.encode("<think>\nso 5\n</think>\n\nThe answer is 5.") + [qwen3.eos_id]
    client = ScriptedClient([t1, t2])
    stats = WorkerStats()
    worker = RolloutWorker(client, SamplingOptions(max_tokens=64, stop_tokens=qwen3.eos_ids),
                           stats=stats)
    task = Task("q", prompt, lambda ids: None, tools=calc_tools(), tokenizer=qwen3, chat=chat)
    rollout = worker._episode(task, seed=0)
    delta = chat.observation_ids(["5"])
    assert rollout.response_ids.tolist() == t1 + delta + t2
    assert rollout.loss_mask.tolist() == [True] * len(t1) + [False] * len(delta) + [True] * len(t2)
    np.testing.assert_array_equal(rollout.logprobs[rollout.loss_mask],
                                  np.concatenate(client.logprobs))
    drift = role == "user"
    assert (stats.template_episodes, stats.template_drift) == (1, int(drift))

    p, r = len(prompt), len(rollout.response_ids)
    batch = pack_rollouts([dataclasses.replace(rollout, advantage=1.0)], seq_len=p + r + 3,
                          with_routing=False)
    full = prompt + t1 + delta + t2
    assert batch.tokens[0, 0, : p + r - 1].tolist() == full[:-1]
    assert batch.targets[0, 0, : p + r - 1].tolist() == full[1:]
    trained = np.flatnonzero(batch.loss_mask[0, 0])
    assert batch.targets[0, 0, trained].tolist() == t1 + t2  # the loss is on sampled tokens only
    np.testing.assert_array_equal(batch.old_logp[0, 0, trained], np.concatenate(client.logprobs))

    # The climb's metrics line and report carry the count.
    report = type("R", (), {"metrics": {}, "groups": [], "staleness": [], "version": 0})()
    record = step_record(report, 0.3, stats, {"stale_rollouts_dropped": 0}, 1.0, 2.0)
    assert (record["template_episodes"], record["template_drift"]) == (1, int(drift))
    assert "template_episodes" not in step_record(report, 0.3, WorkerStats(),
                                                  {"stale_rollouts_dropped": 0}, 1.0, 2.0)


def test_report_counts_template_drift(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    summary = {"worker_stats": {"template_episodes": 8, "template_drift": 3}}
    text = Path(write_report(str(tmp_path), summary, 0.3)).read_text()
    assert "(template drift) | 3 of 8 |" in text
    summary = {"worker_stats": {"template_episodes": 0, "template_drift": 0}}
    assert "template drift" not in Path(write_report(str(tmp_path), summary, 0.3)).read_text()


def test_task_builder_template_observations(qwen3):
    from hcjax.data.tokenizer import ByteTokenizer
    from hcjax.rl.sources import TaskBuilder
    from hcjax.tasks import ArithmeticSuite, ToolUseSuite

    suite = ToolUseSuite()
    problem = suite.train_problem(0)
    task = TaskBuilder(suite, qwen3, template_observations=True).task(problem)
    assert isinstance(task.chat, react.ChatTemplateTurns) and task.chat.role == "tool"
    assert list(task.prompt_ids) == task.chat.prompt_ids()
    assert TaskBuilder(suite, qwen3).task(problem).chat is None  # plain text by default
    arith = ArithmeticSuite()
    assert TaskBuilder(arith, qwen3, template_observations=True).task(
        arith.train_problem(0)).chat is None  # no tools, no episode
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        TaskBuilder(suite, ByteTokenizer(), template_observations=True)
    with pytest.raises(ValueError, match="chat template for observations but no tools"):
        Task("x", [1], lambda ids: None, chat=task.chat)


def test_a_template_that_refuses_the_history_is_drift_without_position(tmp_path):
    folder = tmp_path / "refuses"
    folder.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(FIXTURES / "qwen3" / f, folder / f)
    # ChatML that refuses a tool message after the third message (a long history).
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'tool' and loop.index0 > 2 %}"
        "{{ raise_exception('history too long') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = HFTokenizer.from_pretrained(folder)
    chat = react.ChatTemplateTurns(tok, QUESTION)
    policy = Scripted(tok, [CALL, "5"], [tok.eos_id])
    traj = react.run_episode(chat.prompt_ids(), policy, tok, calc_tools(), chat=chat)
    t1, t2 = policy.sampled
    assert traj.response_ids == t1 + tok.encode("\n<|im_start|>tool\n5<|im_end|>\n"
                                                "<|im_start|>assistant\n") + t2
    assert traj.template_drift is True and traj.template_drift_at is None
