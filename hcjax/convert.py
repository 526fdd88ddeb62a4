"""`python -m hcjax.convert`: Hugging Face folder <-> hcjax Orbax checkpoint.

--from_hf DIR: stream the HF model into its sharding on the gin `MeshConfig` mesh and save it as an
hcjax checkpoint (OUT/checkpoints, the layout `--base_checkpoint` and `load_params` read), plus
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
  python -m hcjax.convert --to_hf runs/climb --hf_source ~/models/Qwen3-30B-A3B --output_dir out/hf
  python -m hcjax.convert --to_hf runs/tiny_base --output_dir out/tiny_hf   # byte tokenizer
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence

from hcjax import config as hcfg
from hcjax.model.hf import copy_side_files


def _extra_args(parser) -> None:
    way = parser.add_mutually_exclusive_group(required=True)
    way.add_argument("--from_hf", metavar="DIR", help="Hugging Face model folder to import")
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
    import argparse

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "examples:" + __doc__.split("Examples:")[1]


def _bar(total: int, unit: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, disable=quiet, dynamic_ncols=True)


def from_hf(src: str, output_dir: str, *, dtype: str = "float32", quiet: bool = False) -> dict:
    """Import an HF folder into OUT/checkpoints; returns the summary items."""
    import jax
    from flax import nnx

    from hcjax.checkpoint import CheckpointConfig, Checkpointer
    from hcjax.distill.sft import model_identity
    from hcjax.model import hf
    from hcjax.model.hf_config import from_hf_config
    from hcjax.sharding import MeshConfig, make_mesh

    t0 = time.perf_counter()
    hf_config = hf.read_hf_config(src)
    cfg = from_hf_config(hf_config, dtype=dtype)
    mesh = make_mesh(MeshConfig())
    report = hf.LoadReport()
    with _bar(len(hf.mapping(cfg)), "param", quiet) as bar:  # closed on an error too
        model, cfg = hf.load(src, dtype=dtype, mesh=mesh, report=report,
                             progress=lambda name: (bar.set_description(name[-40:]),
                                                    bar.update()))
    t_load = time.perf_counter() - t0
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    ckpt = Checkpointer(os.path.join(output_dir, "checkpoints"), CheckpointConfig(async_save=False),
                        {"model_config": model_identity(cfg), "hf_config": hf_config})
    try:
        ckpt.save(0, {"params": params}, force=True)
        ckpt.wait()
    finally:
        ckpt.close()
    write_model_gin(cfg, os.path.join(output_dir, "model.gin"), source=src)
    copy_side_files(src, os.path.join(output_dir, "hf"))
    n = sum(int(x.size) for x in jax.tree.leaves(params))
    return {
        "direction": "from_hf",
        "source": os.path.abspath(src),
        "model_type": hf_config.get("model_type"),
        "parameters": n,
        "mesh": dict(mesh.shape),
        "load_seconds": t_load,
        "total_seconds": time.perf_counter() - t0,
        "largest_tensor_bytes": report.largest_tensor_bytes,
        "peak_host_bytes": report.peak_host_bytes,
        "peak_host_over_largest_tensor": report.peak_over_largest,
        "skipped_tensors": report.skipped_tensors,
    }


def to_hf(src: str, output_dir: str, *, hf_source: str | None = None, dtype: str = "float32",
          max_shard_gb: float = 5.0, quiet: bool = False) -> dict:
    """Export the latest checkpoint of an hcjax run as an HF folder; returns the summary items."""
    import jax
    from flax import nnx

    from hcjax.model import abstract_model, hf

    t0 = time.perf_counter()
    from hcjax.distill.merge import read_checkpoint

    loaded = read_checkpoint(src)  # sft / convert / merge layout, or the climb's {"value": ...}
    step, meta, cfg, params = loaded.step, loaded.meta, loaded.model_cfg, loaded.params
    hf_source = hf_source or (os.path.join(src, "hf") if os.path.isdir(os.path.join(src, "hf"))
                              else None)
    base = meta.get("hf_config")
    if hf_source is not None:
        base = hf.read_hf_config(hf_source)
    else:
        base = _byte_tokenizer_base(cfg, base, src)
    graphdef, abstract = abstract_model(cfg)
    state = nnx.State(abstract)
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    total = sum(int(x.size) for x in jax.tree.leaves(params))
    with _bar(total * (4 if dtype == "float32" else 2), "B", quiet) as bar:
        hf.save(model, output_dir, hf_config=base, dtype=dtype,
                max_shard_bytes=int(max_shard_gb * 2**30), progress=lambda name, n: bar.update(n))
    if hf_source is not None:
        copy_side_files(hf_source, output_dir, skip=("config.json",))
    else:
        from hcjax.data.byte_hf import write_byte_tokenizer

        write_byte_tokenizer(output_dir)
    return {
        "direction": "to_hf",
        "source": os.path.abspath(src),
        "step": step,
        "parameters": total,
        "dtype": dtype,
        "hf_source": hf_source,
        "files": sorted(f for f in os.listdir(output_dir) if f != "convert_logs"),
        "total_seconds": time.perf_counter() - t0,
    }


def _byte_tokenizer_base(cfg, hf_config: dict | None, src: str) -> dict:
    """config.json keys of a run with no HF source, which was trained with the byte tokenizer:
    its token ids. Refuses a run that started from an HF model (its tokenizer is not ours) or
    whose vocabulary cannot hold the byte tokenizer's ids."""
    from hcjax.data.byte_hf import BYTE_TOKEN_IDS
    from hcjax.data.tokenizer import ByteTokenizer

    if hf_config is not None:
        raise ValueError(
            f"--to_hf {src!r}: the run started from a Hugging Face model "
            f"({hf_config.get('model_type')!r}) but neither --hf_source nor {src}/hf is there to "
            "carry its tokenizer over; pass --hf_source"
        )
    if cfg.vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(
            f"--to_hf {src!r}: the run has no HF source, so its tokenizer is the byte tokenizer "
            f"({ByteTokenizer.vocab_size} ids), but ModelConfig.vocab_size={cfg.vocab_size}; "
            "pass --hf_source with the tokenizer it was trained on"
        )
    return dict(BYTE_TOKEN_IDS)


def write_model_gin(cfg, path: str, source: str = "") -> None:
    """`ModelConfig` bindings that rebuild `cfg` (pass with --gin_file to sft / climb / serve)."""
    from hcjax.model import ModelConfig
    from hcjax.model.hf_config import class_defaults

    default = ModelConfig(**class_defaults())
    lines = [f"# ModelConfig of {source} (written by hcjax.convert)."]
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if value != getattr(default, field.name):
            lines.append(f"ModelConfig.{field.name} = {value!r}")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> dict:
    flags = hcfg.parse_flags(argv, description=__doc__.splitlines()[0], extra_args=_extra_args)
    hcfg.bind(flags.gin_files, flags.gin_params)
    args = flags.extra
    if not flags.output_dir:
        raise hcfg.ConfigError("--output_dir is required")
    # An exported HF folder stays clean: the run's own records go into a subfolder of it.
    log_dir = flags.output_dir if args.from_hf else os.path.join(flags.output_dir, "convert_logs")
    hcfg.write_config(log_dir, flags)
    if args.from_hf:
        items = from_hf(args.from_hf, flags.output_dir, dtype=args.dtype or "float32",
                        quiet=args.quiet)
    else:
        items = to_hf(args.to_hf, flags.output_dir, hf_source=args.hf_source,
                      dtype=args.dtype or "float32", max_shard_gb=args.max_shard_gb,
                      quiet=args.quiet)
    from hcjax.metrics import MetricsWriter, write_summary

    with MetricsWriter(log_dir) as metrics:
        metrics.write(0, {k: v for k, v in items.items() if isinstance(v, int | float)})
    print(write_summary(log_dir, f"hcjax.convert {items['direction']}", items))
    print(json.dumps(items))
    return items


if __name__ == "__main__":
    hcfg.run_main(main)
