"""The tool-use suite of the tiny climb: multiply a 2-3 digit number by a 2-digit one through a
`calc` tool in the ReAct loop (hcjax.envs.react), then answer.  The product is beyond a tiny
model's head, so the reward comes from calling the tool and copying its result.  No JAX, and
the tool never calls eval().

One episode, as token ids (ByteTokenizer, our template), piece by piece:

    prompt   <bos><|user|>calc 123*45<|end|><|assistant|>
    turn 1   <tool_call>{"name":"calc","arguments":{"expr":"123*45"}}</tool_call><|end|>
    observe  "\n<tool_result>\n5535\n</tool_result>\n"   (appended by the environment)
    turn 2   <answer>5535</answer><|end|>

The engine stops a turn at `<|end|>` and keeps it in the turn's ids, so the reference response
`TaskProblem.target` is the decoded whole response without its final `<|end|>`, one string:

    '<tool_call>{"name":"calc","arguments":{"expr":"123*45"}}</tool_call><|end|>'
    '\n<tool_result>\n5535\n</tool_result>\n<answer>5535</answer>'

The observation inside it is what `react.default_observation` renders for the right result: in
RL it is appended by the environment with loss mask 0.  Our chat template turns only the
reasoning tags of message content into special tokens, so SFT must not encode this target as one
plain assistant message (the mid-response `<|end|>` would become 7 bytes and the observation
would be trained): `encode_response` gives its token-faithful ids and loss mask, and
`sft_example` the whole SFT document, identical to what an RL episode produces.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence

import gin
import numpy as np

from hcjax.data import tokenizer as T
from hcjax.data.template import (
    encode_content,
    messages_prompt_ids,
    normalize_answer,
    parse_answer,
)
from hcjax.envs import react
from hcjax.envs.tools import (
    CALL_CLOSE,
    CALL_OPEN,
    Tool,
    ToolCall,
    ToolResult,
    ToolSet,
    parse_tool_calls,
)
from hcjax.rewards.types import Grade
from hcjax.tasks.base import SeededSplits, TaskProblem

_SPLIT_CODES = {"train": 0, "heldout": 1}
MAX_EXPR_CHARS = 64
# ASCII only: \d and int() would also take other scripts' digits ("٣").
_EXPR = re.compile(r" *[0-9]+(?: *[-+*] *[0-9]+)* *")
_TOKEN = re.compile(r"[0-9]+|[-+*]")


# The calc tool ---------------------------------------------------------------------------------

def safe_calc(expr: str) -> int:
    """The value of `expr`: non-negative ASCII integers joined by binary + - * (usual
    precedence, spaces allowed), evaluated by hand, never by eval().  ValueError otherwise."""
    if len(expr) > MAX_EXPR_CHARS or not _EXPR.fullmatch(expr):
        raise ValueError(f"expr must be at most {MAX_EXPR_CHARS} characters of non-negative "
                         "integers joined by + - *")
    tokens = _TOKEN.findall(expr)
    total, sign, product = 0, 1, int(tokens[0])
    for op, number in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            product *= int(number)
        else:  # a term ends: add it with its sign and start the next one
            total += sign * product
            sign, product = (1 if op == "+" else -1), int(number)
    return total + sign * product


def calc_tool() -> Tool:
    """`calc(expr)`: integer arithmetic with + - * (the result, or an error that never echoes
    the expression, so a tool output cannot carry text the policy did not write)."""

    def calc(expr: str) -> ToolResult:
        try:
            return ToolResult(str(safe_calc(expr)))
        except ValueError as e:
            return ToolResult(f"error: {e}", ok=False)

    return Tool("calc", "integer arithmetic: digits joined by + - *", {"expr": str}, calc)


def tool_call_text(expr: str) -> str:
    """A model turn calling calc, in the exact format `parse_tool_calls` reads (compact JSON)."""
    body = json.dumps({"name": "calc", "arguments": {"expr": expr}}, separators=(",", ":"))
    return f"{CALL_OPEN}{body}{CALL_CLOSE}"


# Token-faithful targets ------------------------------------------------------------------------

_OBSERVATION = re.compile(re.escape(T.END_TURN) + r"(\n<tool_result>\n.*?\n</tool_result>\n)",
                          re.DOTALL)


def encode_response(response: str, tok: T.Tokenizer) -> tuple[list[int], list[int]]:
    """Ids and loss mask (1 = policy token) of a multi-turn response written like `target`:
    turns end in a literal "<|end|>" (the stop token, mask 1), each followed by an observation
    (`react.default_observation` text, plain bytes, mask 0).  The final turn's `<|end|>` is left
    to the template, as for single-turn targets.  Our template only (ByteTokenizer)."""
    pieces = _OBSERVATION.split(response)  # [turn, observation, turn, ..., turn]
    end = tok.special_id(T.END_TURN)
    ids: list[int] = []
    mask: list[int] = []
    for i, piece in enumerate(pieces):
        if i % 2:
            obs = tok.encode(piece)
            ids += obs
            mask += [0] * len(obs)
            continue
        turn = encode_content(piece, tok) + ([end] if i + 1 < len(pieces) else [])
        ids += turn
        mask += [1] * len(turn)
    return ids, mask


def sft_example(problem: TaskProblem, tok: T.Tokenizer) -> tuple[list[int], list[int]]:
    """The SFT document of a problem in our template, ids and loss mask: the prompt as a sampler
    sees it, the response as an RL episode builds it (observations masked), `<|end|>`, `<eos>`."""
    if problem.target is None:
        raise ValueError(f"problem {problem.id!r} has no reference response (target=None)")
    prompt = messages_prompt_ids(problem.messages, tok)
    ids, mask = encode_response(problem.target, tok)
    return ([*prompt, *ids, tok.special_id(T.END_TURN), tok.eos_id],
            [0] * len(prompt) + mask + [1, 0])


# The suite -------------------------------------------------------------------------------------

@gin.configurable
@dataclasses.dataclass(frozen=True)
class ToolUseSuite(SeededSplits):
    """Products like "calc 123*45", solved by calling `calc` and answering `<answer>N</answer>`.

    min_digits / max_digits: the first factor's digit count, drawn uniformly (the knob);
    other_digits: the second factor's.  Categories "mul:<a>x<b>", e.g. "mul:3x2".
    seed / num_heldout: the held-out split is problems 0..num_heldout-1 of the held-out stream;
      the training stream never yields a pair of factors of the held-out split.
    heldout_min_digits: the held-out split draws the first factor's digit count from
      [heldout_min_digits, max_digits] only (None: from the training range): longer factors a
      base copies only partly; the training stream keeps every length.
    budget: the ReAct budget to run these episodes with (the climb's sources read
      `suite.budget`): two steps (a call and the answer, or a second call), a 256-token context.
    The grade is the last `<answer>` of the decoded whole response (observations included; calc
    outputs are only numbers or fixed errors), answered with or without the tool.
    """

    name: str = "tool_use"
    min_digits: int = 2
    max_digits: int = 3
    other_digits: int = 2
    seed: int = 0
    num_heldout: int = 100
    heldout_min_digits: int | None = None
    budget: react.Budget = react.Budget(max_steps=2, max_context=256, max_time_s=60.0)

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits <= 9:
            raise ValueError(f"ToolUseSuite min_digits={self.min_digits}, max_digits="
                             f"{self.max_digits} must satisfy 1 <= min_digits <= max_digits <= 9")
        if not 1 <= self.other_digits <= 9:
            raise ValueError(f"ToolUseSuite.other_digits={self.other_digits} must be in 1..9")
        if self.num_heldout < 0:
            raise ValueError(f"ToolUseSuite.num_heldout={self.num_heldout} must be >= 0")
        if self.heldout_min_digits is not None and not (
                self.min_digits <= self.heldout_min_digits <= self.max_digits):
            raise ValueError(f"ToolUseSuite.heldout_min_digits={self.heldout_min_digits} must be "
                             f"within min_digits={self.min_digits} .. max_digits="
                             f"{self.max_digits}")
        if not isinstance(self.budget, react.Budget):
            raise ValueError(f"ToolUseSuite.budget={self.budget!r} is not a react.Budget")

    def sft_document(self, problem: TaskProblem, tok: T.Tokenizer) -> tuple[list[int], list[int]]:
        """The SFT document of a problem (`sft_example`): observations masked, as RL sees them."""
        return sft_example(problem, tok)

    def _problem(self, split: str, index: int, attempt: int = 0) -> TaskProblem:
        rng = np.random.default_rng([self.seed, _SPLIT_CODES[split], index, attempt])
        low = self.heldout_min_digits if split == "heldout" else None
        d = int(rng.integers(self.min_digits if low is None else low, self.max_digits + 1))

        def number(digits: int) -> int:
            return int(rng.integers(10 ** (digits - 1) if digits > 1 else 0, 10**digits))

        a, b = number(d), number(self.other_digits)
        expr, answer = f"{a}*{b}", str(a * b)
        target = (tool_call_text(expr) + T.END_TURN
                  + react.default_observation([ToolResult(answer)]) + f"<answer>{answer}</answer>")
        return TaskProblem(
            id=f"mul-{split}-{index}", category=f"mul:{d}x{self.other_digits}",
            messages=({"role": "user", "content": f"calc {expr}"},), reference=answer,
            target=target, meta={"a": a, "b": b})

    def _key(self, problem: TaskProblem) -> tuple:
        return (problem.meta["a"], problem.meta["b"])

    def categories(self) -> Sequence[str]:
        return [f"mul:{d}x{self.other_digits}"
                for d in range(self.min_digits, self.max_digits + 1)]

    def tools(self, problem: TaskProblem) -> ToolSet:
        del problem  # the calculator is stateless: the same for every problem
        return ToolSet([calc_tool()])

    def grade(self, problem: TaskProblem, response: str) -> Grade:
        """1 when the last `<answer>` equals the product; components: "correct" and
        "tool_calls" (how many `<tool_call>` blocks the response made, malformed ones too)."""
        want = normalize_answer(str(problem.reference))
        got = parse_answer(response)
        correct = got is not None and normalize_answer(got) == want
        calls = parse_tool_calls(response)
        ok_calls = sum(isinstance(c, ToolCall) for c in calls)
        reason = ("no <answer> block" if got is None
                  else f"answer {got!r} {'equals' if correct else 'differs from'} {want!r}")
        reason += f" ({len(calls)} tool calls, {ok_calls} well-formed)"
        return Grade(float(correct), reason, correct=correct,
                     components={"correct": float(correct), "tool_calls": float(len(calls))})
