"""Benchmark: sandboxed executions per second with 2 workers against a plain subprocess running
the same program, and math-grader throughput; prints one JSON object as its last line."""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from hcjax import sandbox
from hcjax.display import Phases
from hcjax.rewards import math as math_grader

PROGRAM = "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n"
STDIN = "1 2 3 4 5\n"


def math_cases(k: int) -> list[tuple[str, str]]:
    """Equivalent and different answers; k varies them so the parser's caches do not help."""
    return [
        (f"so \\boxed{{\\frac{{{k}}}{{{2 * k}}}}}", "0.5"),
        (f"<answer>{k}\\sqrt{{2}}</answer>", f"\\sqrt{{{2 * k * k}}}"),
        (f"\\boxed{{[{k},{k + 2})}}", f"[{k}, {k + 2})"),
        (f"\\boxed{{x^2-{k * k}}}", f"(x-{k})(x+{k})"),
        (f"\\boxed{{{k}\\text{{ cm}}}}", f"{k}"),
        (f"\\boxed{{\\frac{{1}}{{{k + 2}}}}}", "0.5"),
    ]


def _plain(_: int) -> bool:
    proc = subprocess.run(["python3", "-c", PROGRAM], input=STDIN, capture_output=True,
                          text=True, timeout=10, env={"PATH": sandbox.SANDBOX_PATH})
    return proc.stdout == "15\n"


def _sandboxed(_: int) -> bool:
    out = sandbox.run(["python3", "-c", PROGRAM], timeout_s=10, memory_mb=256, stdin=STDIN)
    return out.ok and out.stdout == "15\n"


def _rate(fn, runs: int, workers: int) -> float:
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(fn, range(workers)))  # warm up
        start = time.perf_counter()
        results = list(pool.map(fn, range(runs)))
        elapsed = time.perf_counter() - start
    if not all(results):
        raise RuntimeError(f"{fn.__name__}: {results.count(False)} of {runs} runs were wrong")
    return runs / elapsed


EXAMPLES = """examples:
  python -m hcjax.bench.sandbox                        # sandbox start-up and grading throughput
  python -m hcjax.bench.sandbox --runs 50 --workers 2

The last line on stdout is one JSON object; progress goes to stderr.
"""


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m hcjax.bench.sandbox", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES)
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--math_rounds", type=int, default=5)
    args = parser.parse_args(argv)

    phases = Phases("hcjax.bench.sandbox")
    with phases.phase(f"{args.runs} runs plain, then sandboxed", total=2) as phase:
        phase.now("plain")
        plain = _rate(_plain, args.runs, args.workers)
        phase.advance(item="sandboxed")
        boxed = _rate(_sandboxed, args.runs, args.workers)
        phase.advance()

    for response, reference in math_cases(1):  # warm up sympy and the parser
        math_grader.grade(response, reference)
    start = time.perf_counter()
    graded = correct = 0
    with phases.phase("grading math answers", total=args.math_rounds) as phase:
        for k in range(2, 2 + args.math_rounds):
            for i, (response, reference) in enumerate(math_cases(k)):
                ok = math_grader.verify(response, reference)
                correct += ok == (i != 5)  # the last case of each round is a wrong answer
                graded += 1
            phase.advance()
    if correct != graded:
        raise RuntimeError(f"math grader: {graded - correct} of {graded} verdicts were wrong")
    math_rate = graded / (time.perf_counter() - start)

    result = {
        "workers": args.workers,
        "runs": args.runs,
        "plain_runs_per_s": round(plain, 2),
        "sandbox_runs_per_s": round(boxed, 2),
        "sandbox_over_plain": round(boxed / plain, 3),
        "sandbox_overhead_ms_per_run": round(1000 * args.workers * (1 / boxed - 1 / plain), 1),
        "math_grades_per_s": round(math_rate, 1),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)
