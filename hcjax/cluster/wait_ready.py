"""`python -m hcjax.cluster.wait_ready HOST:PORT ...`: block until every rollout service answers
its Health RPC with SERVING, polling with exponential backoff; exit 0 when ready, 1 on timeout,
2 when the token is refused. Launchers run it between starting inference and the learner."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("addresses", nargs="+", help="host:port of each service")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds to wait for all of them (compiles can be slow)")
    parser.add_argument("--any", action="store_true", help="return once one is ready")
    parser.add_argument("--max_backoff", type=float, default=10.0)
    args = parser.parse_args(argv)
    # after the flags: --help stays fast (this loads JAX)
    from hcjax.rollout.service import wait_ready

    try:
        wait_ready(args.addresses, timeout=args.timeout, require="any" if args.any else "all",
                   max_backoff=args.max_backoff,
                   log=lambda line: print(f"wait_ready: {line}", file=sys.stderr, flush=True))
    except TimeoutError as err:
        print(f"wait_ready: {err}", file=sys.stderr)
        return 1
    except PermissionError as err:
        print(f"wait_ready: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)
