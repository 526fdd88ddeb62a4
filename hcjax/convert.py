"""`python -m hcjax.convert`: Hugging Face folder or GGUF file <-> hcjax Orbax checkpoint.

--from_hf DIR (or --from_gguf FILE, a llama.cpp GGUF file, dequantised to float32 with its
tokenizer and chat template read from its metadata): stream the HF model into its sharding on the gin `MeshConfig` mesh and save it as an
hcjax checkpoint (OUT/checkpoints, the layout `--base_checkpoint` and `init_checkpoint` read), plus
OUT/model.gin (the model's `ModelConfig` bindings) and OUT/hf/ (the source's config, generation
config and tokenizer files, for the way back). --to_hf SRC: the params of the latest checkpoint of
an hcjax run (convert, sft or climb) written as an HF folder transformers loads, with the
tokenizer the run used: the HF source's files (--hf_source, else SRC/hf) when the run started from
an HF model; otherwise the run was trained with the byte tokenizer (DataConfig.tokenizer = "byte",
the default) and its Hugging Face form is written (`hcjax.data.byte_hf`: tokenizer.json,
tokenizer_config.json, chat_template.jinja rendering our chat template, generation_config.json
stopping on <eos> and <|end|>). A run trained on another tokenizer folder must name it with
--hf_source.

Examples:
  python -m hcjax.convert --from_hf ~/models/Qwen3-30B-A3B --output_dir runs/qwen3_30b
  python -m hcjax.convert --from_gguf SmolLM2-135M-Instruct.Q4_1.gguf --output_dir runs/smollm2
  python -m hcjax.convert --to_hf runs/climb --hf_source ~/models/Qwen3-30B-A3B --output_dir out/hf
  python -m hcjax.convert --to_hf runs/tiny_base --output_dir out/tiny_hf   # byte tokenizer
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

from hcjax import config as hcfg

__all__ = ["main"]


def _gguf_file(path: str) -> str:
    """argparse `type` of --from_gguf: an existing file that starts with GGUF's magic."""
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"GGUF file {path!r} does not exist")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise argparse.ArgumentTypeError(f"{path!r} is not a GGUF file (no 'GGUF' magic)")
    return os.path.abspath(path)


def _extra_args(parser) -> None:
    way = parser.add_mutually_exclusive_group(required=True)
    way.add_argument("--from_hf", metavar="DIR", help="Hugging Face model folder to import")
    way.add_argument("--from_gguf", metavar="FILE", type=_gguf_file,
                     help="GGUF file to import (dequantised; tokenizer from its metadata)")
    way.add_argument("--to_hf", metavar="SRC", help="hcjax run or checkpoint folder to export")
    parser.add_argument("--dtype", default=None,
                        help="import: compute dtype (default float32); export: tensor dtype "
                             "written (float32 or bfloat16, default float32)")
    parser.add_argument("--hf_source", default=None,
                        help="export: the HF folder the run started from (config keys and "
                             "tokenizer files are carried over); default: SRC/hf if present")
    parser.add_argument("--max_shard_gb", type=float, default=5.0,
                        help="export: safetensors shard size limit in GB (an index above it)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "examples:" + __doc__.split("Examples:")[1]


def main(argv: Sequence[str] | None = None) -> dict:
    """Flags → gin → `hcjax.model_io.hf_to_run` or `run_to_hf` → the summary."""
    flags = hcfg.parse_flags(argv, description=__doc__.splitlines()[0], extra_args=_extra_args)
    # After the flags, so --help stays fast; it registers what a conversion reads from gin
    # (ModelConfig's kernel choices, MeshConfig, CheckpointConfig).
    from hcjax import model_io
    from hcjax.metrics import MetricsWriter, write_summary

    hcfg.bind(flags.gin_files, flags.gin_params)
    args = flags.extra
    if not flags.output_dir:
        raise hcfg.ConfigError("--output_dir is required")
    # An exported HF folder stays clean: the run's own records go into a subfolder of it.
    source = args.from_hf or args.from_gguf
    log_dir = flags.output_dir if source else os.path.join(flags.output_dir, "convert_logs")
    hcfg.write_config(log_dir, flags)
    if source:
        items = model_io.hf_to_run(source, flags.output_dir,
                                   dtype=args.dtype or "float32", quiet=args.quiet)
    else:
        items = model_io.run_to_hf(args.to_hf, flags.output_dir, hf_source=args.hf_source,
                                   dtype=args.dtype or "float32",
                                   max_shard_gb=args.max_shard_gb, quiet=args.quiet)
    with MetricsWriter(log_dir) as metrics:
        metrics.write(0, {k: v for k, v in items.items() if isinstance(v, int | float)})
    print(write_summary(log_dir, f"hcjax.convert {items['direction']}", items))
    print(json.dumps(items))
    return items


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)
