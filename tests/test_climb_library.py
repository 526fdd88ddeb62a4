"""The climb as a library: task suites and mixtures behind `TaskBuilder` and the problem sources,
held-out evaluation through the inference client, reward shaping per suite, `Placement` errors
(also from `python -m hcjax.climb`, before anything compiles), the custom suite of README's
"write your own task", and a climb over a dataset suite that is killed and resumed."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from hcjax.config import cpu_xla_flags
from hcjax.data.template import prompt_ids
from hcjax.data.tokenizer import ByteTokenizer
from hcjax.rewards.spec import RewardSpec
from hcjax.rewards.types import Grade
from hcjax.rl.curriculum import EarlyExit
from hcjax.rl.pass_at_1 import EVAL_PRIORITY, PassAt1, greedy
from hcjax.rl.placement import Placement
from hcjax.rl.sources import PrioritizedSource, SourceConfig, TaskBuilder, make_source
from hcjax.rl.workers import ProblemWorker, RolloutWorker
from hcjax.rollout.request import SampledRollout, SamplingOptions
from hcjax.tasks import ArithmeticSuite, CodeSuite, MixtureSuite, TaskProblem, ToolUseSuite
from hcjax.tasks.base import SuiteBase

REPO = Path(__file__).resolve().parent.parent
TOK = ByteTokenizer()


class OracleClient:
    """Answers each prompt with a scripted response text: `answer(prompt_text)`."""

    def __init__(self, answer):
        self.answer = answer
        self.requests = []

    def generate(self, request, timeout=None):
        self.requests.append(request)
        text = TOK.decode(list(request.prompt))
        out = []
        for i in range(request.n):
            ids = TOK.encode(self.answer(text, i)) + [request.stop_tokens[0]]
            n = len(ids)
            out.append(SampledRollout(
                prompt_ids=np.asarray(request.prompt), response_ids=np.asarray(ids),
                logprobs=np.full(n, -0.1), n_kept=np.ones(n), threshold_logit=np.zeros(n),
                loss_mask=np.ones(n, bool), versions=np.zeros(n), finish_reason="stop",
                sample_index=i, max_tokens=request.max_tokens, stop_tokens=request.stop_tokens))
        return out


def arithmetic_answer(text, i=0):
    a, op, b = re.search(r"(\d+)([+\-*])(\d+)=", text).groups()
    value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    return f"<think></think><answer>{value + (i % 2)}</answer>"  # odd samples are wrong


# Suites, mixtures, sources --------------------------------------------------------------------


def test_mixture_prefixes_dispatches_and_weights():
    mix = MixtureSuite(suites=(ArithmeticSuite(), CodeSuite(num_heldout=4),
                               ToolUseSuite(num_heldout=4)), weights=(2.0, 1.0, 1.0))
    drawn = [mix.train_problem(i) for i in range(600)]
    share = np.mean([p.meta["suite"] == "arithmetic" for p in drawn])
    assert abs(share - 0.5) < 0.08
    assert {p.id.split("/")[0] for p in drawn} == {"arithmetic", "code", "tool_use"}
    assert all(p.category.startswith(p.meta["suite"] + "/") for p in drawn)
    # Grading and tools go to the owning suite with the problem as that suite made it.
    arith = next(p for p in drawn if p.meta["suite"] == "arithmetic")
    assert mix.grade(arith, f"<answer>{arith.reference}</answer>").correct
    tool = next(p for p in drawn if p.meta["suite"] == "tool_use")
    assert mix.tools(tool) is not None and mix.tools(arith) is None
    assert mix.component(tool).name == "tool_use"
    held = mix.heldout()
    assert len(held) == len(ArithmeticSuite().heldout()) + 8
    assert set(mix.categories()) >= {p.category for p in drawn[:50]}
    cat = "code/" + CodeSuite().categories()[0]
    p, cursor = mix.next_in_category(cat, 0)
    assert p.category == cat and cursor >= 1
    with pytest.raises(ValueError, match="must be distinct"):
        MixtureSuite(suites=(ArithmeticSuite(), ArithmeticSuite()))
    with pytest.raises(ValueError, match="weights"):
        MixtureSuite(suites=(ArithmeticSuite(),), weights=(1.0, 2.0))
    with pytest.raises(TypeError, match="is not a TaskSuite"):
        MixtureSuite(suites=(object(),))


def test_task_builder_uses_the_template_and_limits_prompts():
    suite = ArithmeticSuite()
    p = suite.train_problem(3)
    task = TaskBuilder(suite, TOK).task(p)
    assert list(task.prompt_ids) == prompt_ids(p.prompt, TOK)
    assert task.meta["category"] == p.category and task.tools is None
    answer = TOK.encode(f"<think></think><answer>{p.reference}</answer>")
    assert task.grade(answer).correct
    with pytest.raises(ValueError, match=r"-token prompt; the engine's max prefill length is 3"):
        TaskBuilder(suite, TOK, max_prompt_len=3).task(p)
    tool_task = TaskBuilder(ToolUseSuite(), TOK).task(ToolUseSuite().train_problem(0))
    assert tool_task.tools is not None and tool_task.tokenizer is TOK
    assert tool_task.budget == ToolUseSuite().budget


def test_prioritized_source_over_a_mixture_with_a_curriculum():
    mix = MixtureSuite(suites=(ArithmeticSuite(), CodeSuite(num_heldout=4)))
    builder = TaskBuilder(mix, TOK)
    src = make_source(builder, SourceConfig(sampler="prioritized", curriculum_fraction=0.25,
                                            curriculum_steps=10))
    assert isinstance(src, PrioritizedSource)
    first = src.categories[: max(1, int(np.ceil(0.25 * len(src.categories))))]
    early = {src.next_task().meta["category"] for _ in range(40)}
    assert early <= set(first)  # the pool starts with the first quarter of the categories
    src.advance(10)
    late = {src.next_task().meta["category"] for _ in range(400)}
    assert late - set(first)  # and grows to all of them
    state = json.loads(json.dumps(src.state_dict()))
    copy = make_source(builder, SourceConfig(sampler="prioritized", curriculum_fraction=0.25,
                                             curriculum_steps=10))
    copy.load_state_dict(state)
    assert [copy.next_task().id for _ in range(10)] == [src.next_task().id for _ in range(10)]
    with pytest.raises(ValueError, match="SourceConfig.sampler='random'"):
        SourceConfig(sampler="random")


def test_suite_shares_give_each_mixture_member_its_weight():
    mix = MixtureSuite(suites=(ArithmeticSuite(), CodeSuite(num_heldout=4),
                               ToolUseSuite(num_heldout=4)), weights=(2.0, 1.0, 0.0))
    groups, shares = mix.category_shares()
    assert set(groups) == set(mix.categories())  # the zero-weight suite has no category
    assert shares == {"arithmetic": 2.0, "code": 1.0, "tool_use": 0.0}
    assert all(groups[c] == c.split("/")[0] for c in groups)
    src = make_source(TaskBuilder(mix, TOK), SourceConfig(sampler="prioritized", floor=0.01,
                                                          suite_shares=True))
    arithmetic = [c for c in src.categories if c.startswith("arithmetic/")]
    for c in arithmetic[1:]:  # every arithmetic category but one solved: the share stays 2/3
        src.sampler.observe(c, 1.0, 1)
    probs = src.probabilities()
    assert sum(probs[c] for c in arithmetic) == pytest.approx(2 / 3)
    # Inside the share, learnability: 1/4 for the unseen category, the floor for solved ones.
    inner = 0.25 / (0.25 + 0.01 * (len(arithmetic) - 1))
    assert probs[arithmetic[0]] == pytest.approx(2 / 3 * inner)
    drawn = [src.next_task().meta["category"].split("/")[0] for _ in range(600)]
    assert abs(drawn.count("code") / 600 - 1 / 3) < 0.08
    with pytest.raises(ValueError, match="suite_shares=True needs sampler='prioritized'"):
        SourceConfig(suite_shares=True)
    with pytest.raises(ValueError, match="suite 'arithmetic' has no member suites"):
        make_source(TaskBuilder(ArithmeticSuite(), TOK),
                    SourceConfig(sampler="prioritized", suite_shares=True))


# Evaluation and rewards through the workers ---------------------------------------------------


def test_heldout_eval_goes_through_the_client_per_category():
    suite = ArithmeticSuite()
    problems = list(suite.heldout())[:24]
    client = OracleClient(arithmetic_answer)
    sampling = SamplingOptions(max_tokens=16, stop_tokens=(TOK.special_id("<|end|>"),),
                               token_budget=4)
    result = PassAt1(client, TaskBuilder(suite, TOK), problems, greedy(sampling)).evaluate()
    assert result["pass_at_1"] == 1.0 and result["problems"] == 24  # greedy sample 0 is right
    assert set(result["by_category"]) == {p.category for p in problems}
    assert result["extraction"] == {"strict": 1.0, "flexible": 1.0}
    assert all(r.temperature == 0.0 and r.top_p == 1.0 and r.n == 1 and r.token_budget is None
               and r.priority == EVAL_PRIORITY and r.max_tokens == 16 for r in client.requests)


def test_the_climb_samples_with_one_nested_sampling_options():
    """ClimbConfig.sampling is gin's SamplingOptions (its defaults, `SamplingOptions.*`
    bindings over them), built as plain options; SamplingOptions built in code never see those
    bindings; the climb's own stop tokens and seeds may not be set there."""
    from hcjax import config
    from hcjax.rl.climber import ClimbConfig

    config.bind([], ["SamplingOptions.max_tokens = 12", "SamplingOptions.top_p = 0.9"])
    cfg = ClimbConfig()
    assert cfg.sampling == SamplingOptions(max_tokens=12, top_p=0.9)
    assert type(cfg.sampling) is SamplingOptions
    assert cfg.longest_response() == 12 and cfg.max_tokens_at(7) == 12
    assert SamplingOptions().max_tokens == 256  # the one set of defaults, unbound in code
    config.bind([], ["ClimbConfig.sampling = @SamplingOptions()",
                     "SamplingOptions.temperature = 0.5"])
    assert ClimbConfig().sampling == SamplingOptions(temperature=0.5)
    with pytest.raises(ValueError, match=r"stop_tokens=\(7,\) and seed=None: the climb's stop"):
        ClimbConfig(sampling=SamplingOptions(stop_tokens=(7,)))
    with pytest.raises(ValueError, match="seed=3"):
        ClimbConfig(sampling=SamplingOptions(seed=3))
    config.bind([], [])


def test_one_task_config_names_the_suite_and_its_rewards():
    from hcjax.tasks.task_config import TaskConfig

    assert isinstance(TaskConfig().make_suite(), ArithmeticSuite)
    mix = MixtureSuite(suites=(ArithmeticSuite(num_heldout=4), CodeSuite(num_heldout=4)))
    assert TaskConfig(suite=mix, rewards={"code": RewardSpec()}).make_suite() is mix
    with pytest.raises(ValueError, match=r"TaskConfig.rewards names suites \['tool_use'\]; "
                                         r"the task's suites are \['arithmetic', 'code', "):
        TaskConfig(suite=mix, rewards={"tool_use": RewardSpec()}).make_suite()
    with pytest.raises(ValueError, match="must map suite names to RewardSpecs"):
        TaskConfig(rewards={"arithmetic": 1.0})
    with pytest.raises(TypeError, match="TaskConfig.suite=.* is not a TaskSuite"):
        TaskConfig(suite="arithmetic").make_suite()


def test_a_climb_is_given_its_base(tmp_path):
    """The climb trains no base: with neither a run nor a Hugging Face folder it refuses, naming
    what makes one, before building anything."""
    from hcjax import config
    from hcjax.rl.climber import Climb

    config.bind(["climb_tiny.gin"], [])
    with pytest.raises(ValueError, match="a climb starts from a base: give base_checkpoint"):
        Climb(str(tmp_path / "climb"))
    with pytest.raises(ValueError, match="the climb starts from one base, give one"):
        Climb(str(tmp_path / "climb"), base_checkpoint="a", hf_checkpoint="b")
    assert not (tmp_path / "climb").exists()
    config.bind([], [])


def test_reward_spec_shapes_a_group_before_advantages():
    from hcjax.rl.climber import _shaping_for

    suite = ArithmeticSuite()
    spec = RewardSpec(length="kimi", length_weight=1.0)
    shaping = _shaping_for({"arithmetic": spec}, lambda: 16, lambda: 0, TOK.decode)
    builder = TaskBuilder(suite, TOK, shaping=shaping)
    client = OracleClient(lambda text, i: arithmetic_answer(text, i) + " " * (i % 3))
    worker = ProblemWorker(RolloutWorker(client, SamplingOptions(
        max_tokens=32, stop_tokens=(TOK.special_id("<|end|>"),))), EarlyExit(2, 6, (0, 1), (0, 1)))
    group = worker.run(builder.task(suite.train_problem(0)), seed=1)
    assert group.kept
    lengths = [int(r.loss_mask.sum()) for r in group.rollouts]
    correct = [r.reward_components["correct"] > 0 for r in group.rollouts]
    lo, hi = min(lengths), max(lengths)
    for r, n, ok in zip(group.rollouts, lengths, correct, strict=True):
        lam = 0.5 - (n - lo) / (hi - lo)
        term = lam if ok else min(0.0, lam)  # Kimi: wrong answers get no length bonus
        assert r.reward == pytest.approx(float(ok) + term)
        assert r.reward_components["len_kimi"] == pytest.approx(term)
    assert abs(sum(r.advantage for r in group.rollouts)) < 1e-6


# Placement -----------------------------------------------------------------------------------


def test_placement_resolves_and_names_bad_bindings():
    devices = jax.devices()
    p = Placement(learner_mesh={"fsdp": 2, "num_devices": 2},
                  inference_meshes=[{"device_offset": 2, "num_devices": 2},
                                    {"tensor": 2, "fsdp": 1, "device_offset": 4,
                                     "num_devices": 2}]).resolve(devices)
    assert dict(p.learner_mesh.shape)["fsdp"] == 2 and len(p.inference_meshes) == 2
    assert p.describe()["inference"][1]["devices"] == [4, 5]
    with pytest.raises(ValueError, match=r"Placement.learner_mesh=.*cannot be formed from the "
                                         r"8 devices"):
        Placement(learner_mesh={"num_devices": 64}).resolve(devices)
    with pytest.raises(ValueError, match=r"Placement.inference_meshes\[0\] uses device 0"):
        Placement(inference_meshes=[{"num_devices": 1}]).resolve(devices)
    with pytest.raises(ValueError, match="unknown keys \\['gpus'\\]"):
        Placement(learner_mesh={"gpus": 2}).resolve(devices)
    with pytest.raises(ValueError, match="expected host:port"):
        Placement(inference_addresses=["nowhere"]).resolve(devices)
    remote = Placement(inference_addresses=["127.0.0.1:5000"]).resolve(devices)
    assert remote.remote and remote.inference_meshes == ()


def test_climb_with_an_impossible_mesh_fails_before_compiling(tmp_path):
    env = dict(os.environ, XLA_FLAGS=cpu_xla_flags(2),
               JAX_PLATFORMS="cpu")
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "hcjax.climb", "--output_dir", str(tmp_path),
         "--gin_param", "Placement.learner_mesh = {'fsdp': 4, 'num_devices': 4}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Placement.learner_mesh=MeshConfig(" in proc.stderr
    assert "cannot be formed from the 2 devices present" in proc.stderr
    assert not (tmp_path / "base").exists()  # nothing was pre-trained or compiled
    assert time.time() - t0 < 100


# README: write your own task ------------------------------------------------------------------


def readme_suite_source() -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(r"## Write your own task\n.*?```python\n(.*?)```", text, re.DOTALL)
    assert match, "README has no 'Write your own task' section with a python block"
    return match.group(1)


def test_readme_custom_suite_runs_through_the_climb_seams():
    source = readme_suite_source()
    assert len(source.strip().splitlines()) <= 25
    namespace: dict = {}
    exec(compile(source, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    suite = namespace["Reverse"]()
    p = suite.train_problem(5)
    assert isinstance(p, TaskProblem) and p not in suite.heldout()
    assert suite.grade(p, f"<answer>{p.reference}</answer>").correct
    assert not suite.grade(p, "<answer>nope</answer>").correct
    task = TaskBuilder(suite, TOK).task(p)
    src = make_source(TaskBuilder(suite, TOK), SourceConfig(sampler="prioritized"))
    assert src.next_task().meta["category"] in suite.categories()
    assert task.grade(TOK.encode(f"<answer>{p.reference}</answer>")).correct
    assert isinstance(suite, SuiteBase) and isinstance(suite.grade(p, ""), Grade)


# A dataset suite climbed, killed and resumed ----------------------------------------------------


@pytest.mark.slow
def test_dataset_suite_climb_resumes_after_kill(tiny_base, tmp_path):
    from tests.test_climb import TINY, env

    data = tmp_path / "sums.jsonl"
    rng = np.random.default_rng(0)
    with open(data, "w") as f:
        for i in range(300):
            a, b = (int(x) for x in rng.integers(0, 5, 2))
            f.write(json.dumps({"question": f"{a}+{b}=", "answer": str(a + b), "id": i}) + "\n")
    params = [*TINY, "TaskConfig.suite = @DatasetSuite()", f"DatasetSuite.path = '{data}'",
              "DatasetSuite.convention = 'plain'", "DatasetSuite.prompt_template = '{question}'",
              "DatasetSuite.num_heldout = 8", "DatasetSuite.extraction = 'flexible'"]

    def command(out, steps, *extra):
        args = [sys.executable, "-m", "hcjax.climb", "--output_dir", str(out), "--quiet",
                "--base_checkpoint", str(tiny_base)]  # the suite does not change the base
        for b in [*params, f"ClimbConfig.num_steps = {steps}"]:
            args += ["--gin_param", b]
        return args + list(extra)

    out = tmp_path / "climb"
    proc = subprocess.Popen(command(out, 200), cwd=REPO, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ckpts = out / "checkpoints"
    deadline = time.time() + 400
    try:
        while time.time() < deadline:
            done = [int(p.name) for p in ckpts.glob("*") if p.name.isdigit()] \
                if ckpts.is_dir() else []
            if done and max(done) >= 2:
                break
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            time.sleep(0.5)
        else:
            pytest.fail("the climb wrote no checkpoint past step 2 in 400 s")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    run = subprocess.run(command(out, max(done) + 2), cwd=REPO, env=env(), capture_output=True,
                         text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["suite"] == "dataset" and s["resumed_from"] >= 2 and s["steps"] == max(done) + 2
    assert set(s["extraction"]) == {"strict", "flexible"}
    from hcjax.rl.store import read_groups

    accepted = read_groups(str(out / "rollouts"), accepted_only=True)
    assert len(accepted) == s["accepted_groups_consumed"] + s["buffered_groups"]
    assert s["categories"] and all(0.0 <= v["final"] <= 1.0 for v in s["categories"].values())


def test_length_curriculum_sets_the_response_budget_by_step():
    from hcjax.rl.climber import ClimbConfig
    from hcjax.rl.curriculum import LengthCurriculum

    eight = SamplingOptions(max_tokens=8)
    cfg = ClimbConfig(sampling=eight, length_curriculum=LengthCurriculum(
        stage_steps=(3, 3), start=16, end=64))
    assert [cfg.max_tokens_at(s) for s in (0, 2, 3, 5, 6, 100)] == [16, 16, 32, 32, 64, 64]
    assert cfg.longest_response() == 64  # the engine is sized for the last stage
    assert ClimbConfig(sampling=eight).max_tokens_at(50) == 8


@pytest.mark.slow
def test_gsm8k_config_climbs_a_fixture_checkpoint(tmp_path):
    """configs/climb_gsm8k.gin as shipped (the bundled sample file, the GSM8K convention, the
    checkpoint's chat template) on the fixture-sized Qwen3-MoE, with small sizes."""
    from tests.hf_fixtures import fixture
    from tests.test_climb import env

    out = tmp_path / "gsm8k"
    small = [
        "ClimbConfig.num_steps = 2", "ClimbConfig.group = 4", "ClimbConfig.early_group = 2",
        "ClimbConfig.early_window = (0.0, 1.0)", "ClimbConfig.full_window = (0.0, 1.0)",
        "SamplingOptions.max_tokens = 8", "ClimbConfig.eval_every = 1",
        "ClimbConfig.eval_problems = 4", "ClimbConfig.max_concurrent_decodes = 8",
        "ClimbConfig.max_prompt_len = 240", "ClimbConfig.checkpoint_every = 1",
        "ControllerConfig.groups_per_batch = 2", "ControllerConfig.num_workers = 4",
        "ControllerConfig.sync_every = 1", "LearnerConfig.seq_len = 256",
        "LearnerConfig.mask_truncated = False", "ModelConfig.dtype = 'float32'",
    ]
    cmd = [sys.executable, "-m", "hcjax.climb", "--hf_checkpoint", fixture("qwen3_moe"),
           "--gin_file", "climb_gsm8k.gin", "--output_dir", str(out), "--quiet"]
    for b in small:
        cmd += ["--gin_param", b]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["suite"] == "gsm8k" and s["steps"] == 2
    assert set(s["extraction"]) == {"strict", "flexible"}
    from hcjax.data.tokenizer import load_tokenizer
    from hcjax.rl.store import read_groups

    tok = load_tokenizer(fixture("qwen3_moe"))
    group = read_groups(str(out / "rollouts"))[0]
    question = next(json.loads(line)["question"]
                    for line in (REPO / "configs/data/gsm8k_sample.jsonl").read_text().splitlines()
                    if json.loads(line)["question"][:40] in tok.decode(
                        group.rollouts[0].prompt_ids.tolist()))
    assert question  # the prompt is the sample file's question in the folder's chat template
    assert tok.decode(group.rollouts[0].prompt_ids.tolist()).startswith(
        tok.render_chat_template([{"role": "user", "content": "x"}])[:10])


def test_readme_custom_suite_binds_from_a_gin_file(tmp_path):
    """README's recipe: the suite in a module on PYTHONPATH, `import my_tasks` in a gin file."""
    (tmp_path / "my_tasks.py").write_text(readme_suite_source())
    (tmp_path / "reverse.gin").write_text(
        "include 'climb_tiny.gin'\nimport my_tasks\nTaskConfig.suite = @Reverse()\n")
    # As `python -m hcjax.climb --gin_file reverse.gin` does: the climb imported, then bound.
    code = ("from hcjax import config\n"
            "from hcjax.rl.climber import ClimbConfig\n"
            "from hcjax.tasks.task_config import TaskConfig\n"
            f"config.bind([{str(tmp_path / 'reverse.gin')!r}], [])\n"
            "print(TaskConfig().make_suite().train_problem(1).messages[0]['content'])\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("reverse ")


def test_subset_suite_keeps_categories_without_held_out_problems():
    from hcjax.tasks import SubsetSuite

    code = CodeSuite(max_digits=2, num_heldout=40)
    easy = SubsetSuite(suite=code, categories_kept=["affine:1d", "mod:1d"], name="easy")
    drawn = [easy.train_problem(i) for i in range(60)]
    assert {p.category for p in drawn} <= {"affine:1d", "mod:1d"}
    held = {p.prompt for p in code.heldout()}
    assert not held & {p.prompt for p in drawn}  # the parent's stream: no held-out problem
    assert easy.train_problem(7) == drawn[7]  # deterministic
    assert {p.category for p in easy.heldout()} <= {"affine:1d", "mod:1d"}
    with pytest.raises(ValueError, match="categories_kept"):
        SubsetSuite(suite=code, categories_kept=["affine:9d"])
    # A subset of a tool suite runs its episodes under the parent's budget, inside a mixture too.
    tool = ToolUseSuite(min_digits=2, max_digits=4, num_heldout=4)
    hard = SubsetSuite(suite=tool, categories_kept=["mul:4x2"], name="tool_use")
    mix = MixtureSuite(suites=(ArithmeticSuite(num_heldout=4), hard))
    task = TaskBuilder(mix, TOK).task(mix.next_in_category("tool_use/mul:4x2", 0)[0])
    assert task.tools is not None and task.budget == tool.budget and easy.budget is None


def test_tool_episodes_stop_at_the_engine_context():
    from hcjax.envs import react
    from hcjax.envs.tools import ToolResult

    suite = ToolUseSuite()
    task = TaskBuilder(suite, TOK, max_context=40).task(suite.train_problem(0))
    assert task.budget.max_context == 40 and task.budget.max_steps == suite.budget.max_steps
    calls = []

    def policy(ids):  # always calls the tool; the observations soon fill the context
        calls.append(len(ids))
        return TOK.encode('<tool_call>{"name":"calc","arguments":{"expr":"1+1"}}</tool_call>')

    def tools(call):
        return ToolResult("x" * 200)

    traj = react.run_episode(task.prompt_ids, policy, TOK, tools,
                             react.Budget(max_steps=50, max_context=120))
    assert traj.finish_reason == react.CONTEXT and len(calls) == 1
    assert len(traj.prompt_ids) + len(traj.response_ids) == 120
    assert all(n < 120 for n in calls)  # no turn was asked to prefill past the context


def test_mixed_config_holds_out_and_climbs_the_harder_halves_with_shares():
    from hcjax import config
    from hcjax.rl.climber import ClimbConfig, engine_lengths
    from hcjax.tasks.task_config import TaskConfig
    from hcjax.tasks.tool_use import encode_response

    config.bind(["climb_mixed_tiny.gin"], [])
    cfg, source = ClimbConfig(), SourceConfig()
    mix = TaskConfig().make_suite()
    assert source.suite_shares and source.sampler == "prioritized"
    groups, shares = mix.category_shares()
    assert set(groups.values()) == {"arithmetic", "code", "tool_use"} and all(shares.values())
    held = {s.name: s.heldout() for s in mix.suites}
    assert {name: len(h) for name, h in held.items()} == {"arithmetic": 1000, "code": 300,
                                                         "tool_use": 300}
    assert cfg.eval_problems >= len(mix.heldout())  # every held-out problem is evaluated
    assert all(p.meta["difficulty"] == 2 for p in held["arithmetic"])
    assert {p.category.split(":")[1] for p in held["code"]} == {"2d"}
    assert {p.category for p in held["tool_use"]} == {"mul:4x2"}
    # The climb draws arithmetic where its held-out split is: two-digit first operands.
    assert {c for c in groups if c.startswith("arithmetic/")} == {
        f"arithmetic/{k}:2x{b}" for k in ("add", "sub") for b in (1, 2)}
    assert {c for c in groups if c.startswith("tool_use/")} == {"tool_use/mul:4x2"}
    # The longest tool call is one model turn, and a whole episode fits the engine's prefill.
    lengths = engine_lengths(cfg, mix, TOK, 256)
    ids_masks = [encode_response(p.target, TOK) for p in held["tool_use"]]
    assert max(mask.index(0) for _, mask in ids_masks) <= cfg.sampling.max_tokens
    assert max(len(prompt_ids(p.prompt, TOK)) + len(ids)
               for p, (ids, _) in zip(held["tool_use"], ids_masks)) <= lengths.max_prefill_length
