"""Pass@1 evaluation of a model on verifiable problems with greedy or temperature sampling, using
the model's KV cache (prefill of right-padded prompts, then one token per step per row)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hcjax.data.problem import TaskProblem
from hcjax.data.template import normalize_answer, prompt_ids, response_answer, stop_ids
from hcjax.data.tokenizer import ByteTokenizer, Tokenizer
from hcjax.model import init_cache

_FN_CACHE: dict = {}


def _step_fns(graphdef, rest):
    """Jitted prefill/decode for a model structure, compiled once per structure and shape."""
    cacheable = not jax.tree.leaves(rest)
    if cacheable and graphdef in _FN_CACHE:
        return _FN_CACHE[graphdef]

    @jax.jit
    def prefill(params, tokens, positions, lengths, cache):
        out = nnx.merge(graphdef, params, rest)(tokens, positions=positions, cache=cache)
        last = jnp.take_along_axis(out.logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return last, out.cache

    @jax.jit
    def decode(params, tokens, positions, cache):
        out = nnx.merge(graphdef, params, rest)(tokens, positions=positions, cache=cache)
        return out.logits[:, -1], out.cache

    if cacheable:
        _FN_CACHE[graphdef] = (prefill, decode)
    return prefill, decode


def _pick(logits: jax.Array, temperature: float, key: jax.Array | None) -> jax.Array:
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


def generate(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop: Sequence[int],
    temperature: float = 0.0,
    seed: int = 0,
) -> list[list[int]]:
    """Continue each prompt until a stop token (kept) or `max_new_tokens`; greedy when
    temperature == 0. Rows are independent (each has its own positions)."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    cfg = model.config
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    prefill, decode = _step_fns(graphdef, rest)
    b = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    width = int(lengths.max())
    if width + max_new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"prompt length {width} + max_new_tokens={max_new_tokens} exceeds "
            f"max_seq_len={cfg.max_seq_len}"
        )
    tokens = np.zeros((b, width), np.int32)
    positions = np.full((b, width), -1, np.int32)  # -1: padding, never cached nor attended
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
        positions[i, : len(p)] = np.arange(len(p))
    cache = init_cache(cfg, b, width + max_new_tokens)
    key = jax.random.key(seed)
    logits, cache = prefill(params, tokens, positions, jnp.asarray(lengths), cache)
    stop_arr = np.asarray(list(stop), np.int32)
    out = np.zeros((b, max_new_tokens), np.int32)
    done = np.zeros(b, bool)
    n = 0
    for t in range(max_new_tokens):
        key, sub = jax.random.split(key)
        nxt = np.asarray(_pick(logits, temperature, sub))
        out[:, t] = nxt
        n = t + 1
        done |= np.isin(nxt, stop_arr)
        if done.all() or t == max_new_tokens - 1:
            break
        pos = (lengths + t)[:, None]
        logits, cache = decode(params, nxt[:, None], pos, cache)
    result = []
    for row in out[:, :n]:
        hits = np.flatnonzero(np.isin(row, stop_arr))
        result.append(row[: hits[0] + 1].tolist() if hits.size else row.tolist())
    return result


def grade_response(problem: TaskProblem, text: str, tok: Tokenizer) -> bool:
    """Whether a decoded response's answer equals `problem.reference` (`normalize_answer`): its
    `<answer>` block for our template; for a Hugging Face chat template, whose models need not
    write `<answer>` tags, the answer `hcjax.data.template.hf_answer` reads (tag, `\\boxed{}`, or
    last number after the reasoning)."""
    got = response_answer(text, tok)
    return got is not None and normalize_answer(got) == normalize_answer(str(problem.reference))


@dataclasses.dataclass
class EvalResult:
    num_problems: int
    num_samples: int
    pass_at_1: float  # mean over problems of the fraction of correct samples
    format_rate: float  # fraction of samples with an answer (an <answer> block in our template)
    by_kind: dict[str, float]
    by_difficulty: dict[int, float]
    examples: list[dict[str, Any]]

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_problems": self.num_problems,
            "num_samples": self.num_samples,
            "pass_at_1": self.pass_at_1,
            "format_rate": self.format_rate,
        }
        out.update({f"pass_at_1_{k}": v for k, v in sorted(self.by_kind.items())})
        out.update({f"pass_at_1_d{k}": v for k, v in sorted(self.by_difficulty.items())})
        out["examples"] = self.examples
        return out


def evaluate_problems(
    model: nnx.Module,
    problems: Sequence[TaskProblem],
    tok: Tokenizer | None = None,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    num_samples: int = 1,
    seed: int = 0,
    batch_size: int = 256,
) -> EvalResult:
    """pass@1 of `model` on `problems` (greedy by default; with temperature > 0, the mean
    correctness of `num_samples` samples per problem)."""
    if not problems:
        raise ValueError("problems is empty; nothing to evaluate")
    if num_samples < 1 or (temperature == 0.0 and num_samples != 1):
        raise ValueError(f"num_samples={num_samples} must be 1 for greedy and >= 1 when sampling")
    tok = tok or ByteTokenizer()
    stop = stop_ids(tok)
    jobs = [(p, s) for p in problems for s in range(num_samples)]
    correct = np.zeros(len(jobs), bool)
    formatted = np.zeros(len(jobs), bool)
    texts: list[str] = []
    for start in range(0, len(jobs), batch_size):
        chunk = jobs[start : start + batch_size]
        outs = generate(
            model,
            [prompt_ids(p.prompt, tok) for p, _ in chunk],
            max_new_tokens,
            stop,
            temperature,
            seed=seed + start,
        )
        for j, ((p, _), ids) in enumerate(zip(chunk, outs, strict=True)):
            text = tok.decode(ids)
            texts.append(text)
            correct[start + j] = grade_response(p, text, tok)
            formatted[start + j] = response_answer(text, tok) is not None
    per_problem = correct.reshape(len(problems), num_samples).mean(axis=1)
    by_kind: dict[str, list[float]] = defaultdict(list)
    by_difficulty: dict[int, list[float]] = defaultdict(list)
    for p, v in zip(problems, per_problem, strict=True):
        by_kind[p.meta.get("kind") or "all"].append(float(v))
        by_difficulty[p.meta.get("difficulty", 0)].append(float(v))
    examples = [
        {"prompt": p.prompt, "answer": p.reference, "response": texts[i * num_samples]}
        for i, p in enumerate(problems[:5])
    ]
    return EvalResult(
        num_problems=len(problems),
        num_samples=num_samples,
        pass_at_1=float(per_problem.mean()),
        format_rate=float(formatted.mean()),
        by_kind={k: float(np.mean(v)) for k, v in by_kind.items()},
        by_difficulty={k: float(np.mean(v)) for k, v in by_difficulty.items()},
        examples=examples,
    )
