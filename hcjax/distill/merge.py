"""Model merging (Kimi k1.5 long2short, RECIPE §5): the weighted average of two or more checkpoints
of one architecture, and task-vector arithmetic base + Σ λ_i (ft_i − base); plus the reader and
writer of params that every step after the climb shares (SFT and climb checkpoints alike).

`python -m hcjax.distill.merge --checkpoint A --checkpoint B --weights 0.5,0.5 [--base BASE]
--output_dir OUT` writes OUT/checkpoints in the layout `load_params` reads, so OUT is a
`--base_checkpoint` of the climb and an `SFTConfig.init_checkpoint`. The maths are pure functions
of param trees; no training here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hcjax.display import Phases

__all__ = [
    "LoadedCheckpoint",
    "check_same_architecture",
    "load_model",
    "merge_checkpoints",
    "read_checkpoint",
    "task_arithmetic",
    "weighted_average",
    "write_checkpoint",
]


# Pure maths on param trees ----------------------------------------------------------------------
def _leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def check_same_tree(trees: Sequence[Any], names: Sequence[str] | None = None) -> None:
    """Raise a ValueError naming the first difference when the trees do not share structure and
    leaf shapes (names: how to call each tree in the message)."""
    names = list(names or [f"tree {i}" for i in range(len(trees))])
    ref = dict(_leaves_with_paths(trees[0]))
    for name, tree in zip(names[1:], trees[1:], strict=True):
        other = dict(_leaves_with_paths(tree))
        if set(other) != set(ref):
            only_a = sorted(set(ref) - set(other))[:3]
            only_b = sorted(set(other) - set(ref))[:3]
            raise ValueError(f"{name} has a different param tree from {names[0]}: only in "
                             f"{names[0]}: {only_a}; only in {name}: {only_b}")
        for path, leaf in ref.items():
            if tuple(np.shape(leaf)) != tuple(np.shape(other[path])):
                raise ValueError(f"param {path} has shape {tuple(np.shape(other[path]))} in "
                                 f"{name} but {tuple(np.shape(leaf))} in {names[0]}")


def weighted_average(trees: Sequence[Any], weights: Sequence[float]) -> Any:
    """Σ_i w_i θ_i / Σ_i w_i, leaf by leaf, computed in float32 and cast back to each leaf's
    dtype. Weights are normalised (0.5, 0.5 and 1, 1 are the same merge); negatives refused."""
    if len(trees) < 2:
        raise ValueError(f"weighted_average needs two or more trees, got {len(trees)}")
    if len(weights) != len(trees):
        raise ValueError(f"weights={list(weights)} has {len(weights)} entries for "
                         f"{len(trees)} trees")
    w = np.asarray(weights, np.float64)
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights={list(weights)} must be non-negative with a positive sum")
    w = w / w.sum()
    check_same_tree(trees)

    def avg(*leaves):
        acc = sum(float(wi) * jnp.asarray(x, jnp.float32) for wi, x in zip(w, leaves, strict=True))
        return acc.astype(jnp.asarray(leaves[0]).dtype)

    return jax.tree.map(avg, *trees)


def task_arithmetic(base: Any, finetuned: Sequence[Any], lambdas: Sequence[float]) -> Any:
    """Task vectors (Ilharco et al.): θ = θ_base + Σ_i λ_i (θ_i − θ_base), in float32, cast back.
    λ_i are used as given (not normalised); with λ summing to 1 it equals the weighted average
    of the fine-tuned trees."""
    if not finetuned:
        raise ValueError("task_arithmetic needs at least one fine-tuned tree")
    if len(lambdas) != len(finetuned):
        raise ValueError(f"lambdas={list(lambdas)} has {len(lambdas)} entries for "
                         f"{len(finetuned)} fine-tuned trees")
    check_same_tree([base, *finetuned],
                    ["base", *(f"fine-tuned {i}" for i in range(len(finetuned)))])

    def combine(b, *fts):
        b32 = jnp.asarray(b, jnp.float32)
        acc = b32 + sum(float(lam) * (jnp.asarray(f, jnp.float32) - b32)
                        for lam, f in zip(lambdas, fts, strict=True))
        return acc.astype(jnp.asarray(b).dtype)

    return jax.tree.map(combine, base, *finetuned)


# Checkpoints ------------------------------------------------------------------------------------
@dataclasses.dataclass
class LoadedCheckpoint:
    """The params (a pure dict of arrays) of a run's latest checkpoint and what it was made of."""

    directory: str
    step: int
    params: Any
    model_cfg: Any  # hcjax.model.ModelConfig
    meta: dict[str, Any]

    def identity(self) -> dict[str, Any]:
        from hcjax.distill.sft import model_identity

        return model_identity(self.model_cfg)


def _checkpoint_folder(directory: str) -> str:
    ckpt_dir = os.path.join(directory, "checkpoints")
    ckpt_dir = ckpt_dir if os.path.isdir(ckpt_dir) else directory
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint {directory!r}: no such run or checkpoint folder")
    return ckpt_dir


def read_checkpoint(directory: str, step: int | None = None) -> LoadedCheckpoint:
    """Params of `step` (default the latest) of an hcjax run or checkpoints/ folder: sft, convert,
    merge (a plain pure dict) or climb (each param saved as {"value": array}), on one device, with
    the ModelConfig recorded in its meta."""
    import orbax.checkpoint as ocp
    from flax import nnx

    from hcjax.checkpoint import CheckpointConfig, Checkpointer
    from hcjax.model import ModelConfig, abstract_model

    ckpt_dir = _checkpoint_folder(directory)
    mngr = ocp.CheckpointManager(ckpt_dir, item_handlers={"meta": ocp.JsonCheckpointHandler()})
    try:
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"checkpoint {directory!r}: no checkpoint in {ckpt_dir!r}")
        meta = dict(mngr.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))["meta"] or {})
    finally:
        mngr.close()
    if "model_config" not in meta:
        raise ValueError(f"checkpoint {ckpt_dir!r} step {step} records no model_config")
    cfg = ModelConfig(**meta["model_config"])
    _, abstract = abstract_model(cfg)
    target = nnx.to_pure_dict(nnx.State(abstract).filter(nnx.Param))
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=here), target)
    ck = Checkpointer(ckpt_dir, CheckpointConfig(async_save=False), {})
    try:
        try:
            params = ck.restore_subtree(step, "params", target)
        except ValueError as e:
            # The climb's learner saves each parameter as {"value": array} (an nnx.State).
            if "different structure" not in str(e):
                raise
            wrapped = jax.tree.map(lambda t: {"value": t}, target)
            params = jax.tree.map(
                lambda d: d["value"], ck.restore_subtree(step, "params", wrapped),
                is_leaf=lambda x: isinstance(x, dict) and set(x) == {"value"},
            )
    finally:
        ck.close()
    return LoadedCheckpoint(os.path.abspath(directory), int(step), params, cfg, meta)


def check_same_architecture(checkpoints: Sequence[LoadedCheckpoint]) -> None:
    """Raise a ValueError naming the differing ModelConfig fields (kernel choices aside) or the
    first differing param when the checkpoints are not of one architecture."""
    first = checkpoints[0]
    a = first.identity()
    for ck in checkpoints[1:]:
        b = ck.identity()
        diff = [f"{k}: {a.get(k)!r} in {first.directory!r}, {b.get(k)!r} in {ck.directory!r}"
                for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        if diff:
            raise ValueError("checkpoints of different architectures cannot be merged: "
                             + "; ".join(diff))
    check_same_tree([c.params for c in checkpoints], [c.directory for c in checkpoints])


def write_checkpoint(output_dir: str, params: Any, model_cfg: Any, *, step: int = 0,
                     extra_meta: dict[str, Any] | None = None) -> str:
    """Save `params` as OUTPUT_DIR/checkpoints step `step` in the layout of an hcjax.sft run
    (meta {"model_config": model_identity}), which `load_params`, `--base_checkpoint` and
    `SFTConfig.init_checkpoint` read. Returns the checkpoints folder."""
    from hcjax.checkpoint import CheckpointConfig, Checkpointer
    from hcjax.distill.sft import model_identity

    ckpt_dir = os.path.join(os.path.abspath(output_dir), "checkpoints")
    meta = {"model_config": model_identity(model_cfg), **(extra_meta or {})}
    ck = Checkpointer(ckpt_dir, CheckpointConfig(async_save=False), meta)
    try:
        if ck.latest_step() is not None:
            raise FileExistsError(f"{ckpt_dir!r} already holds checkpoints "
                                  f"{ck.all_steps()}; choose an empty output_dir")
        ck.save(step, {"params": params}, force=True)
        ck.wait()
    finally:
        ck.close()
    return ckpt_dir


def load_model(directory: str, mesh: Any = None, model_cfg: Any = None):
    """(model, ModelConfig) with the latest params of any hcjax run (sft, climb, merge, convert);
    `model_cfg` (e.g. with other kernel choices) must have the checkpoint's identity. On `mesh`
    (default: one device)."""
    from flax import nnx

    from hcjax.distill.sft import model_identity
    from hcjax.model import create_sharded
    from hcjax.sharding import MeshConfig, make_mesh

    loaded = read_checkpoint(directory)
    cfg = model_cfg or loaded.model_cfg
    if model_identity(cfg) != loaded.identity():
        raise ValueError(f"checkpoint {directory!r} was written for another ModelConfig than "
                         "the one given")
    mesh = mesh if mesh is not None else make_mesh(MeshConfig(num_devices=1))
    model = create_sharded(cfg, mesh)
    _, state, _ = nnx.split(model, nnx.Param, ...)
    target = nnx.to_pure_dict(state)
    placed = jax.tree.map(lambda new, like: jax.device_put(new, like.sharding),
                          loaded.params, target)
    nnx.replace_by_pure_dict(state, placed)
    nnx.update(model, state)
    return model, cfg


def merge_checkpoints(directories: Sequence[str], output_dir: str, *,
                      weights: Sequence[float] | None = None,
                      base: str | None = None, phases: Phases | None = None) -> dict[str, Any]:
    """Merge the latest params of `directories` into OUTPUT_DIR (see `write_checkpoint`).

    Without `base`: the weighted average (weights default equal); a single checkpoint is only
    re-written in the sft layout ("export"). With `base`: task vectors, base + Σ λ_i (θ_i − base)
    with λ = weights (default 1/n each). Returns the summary. phases: where reading, merging and
    writing show as phases (default: nowhere)."""
    if not directories:
        raise ValueError("merge_checkpoints: no checkpoint given")
    phases = phases or Phases("hcjax.distill.merge", mode="off")
    weights = list(weights) if weights is not None else [1.0 / len(directories)] * len(directories)
    sources = list(directories) + ([base] if base is not None else [])
    read = []
    with phases.phase("reading checkpoints", total=len(sources)) as phase:
        for d in sources:
            phase.now(d)
            read.append(read_checkpoint(d))
            phase.advance()
    loaded, base_ck = read[: len(directories)], (read[-1] if base is not None else None)
    check_same_architecture(([base_ck] if base_ck else []) + loaded)
    if base_ck is None and len(loaded) == 1:
        # One checkpoint, no base: re-written in the sft layout (e.g. a climb's params for
        # SFTConfig.init_checkpoint, which reads only that layout).
        params, method = loaded[0].params, "export"
    elif base_ck is None:
        with phases.phase(f"averaging {len(loaded)} checkpoints"):
            params = weighted_average([c.params for c in loaded], weights)
        method = "weighted_average"
    else:
        with phases.phase(f"adding {len(loaded)} task vectors to the base"):
            params = task_arithmetic(base_ck.params, [c.params for c in loaded], weights)
        method = "task_arithmetic"
    # An HF source travels on when every input shares it (its tokenizer files, for --to_hf).
    hf_configs = {json.dumps(c.meta.get("hf_config"), sort_keys=True) for c in loaded}
    extra = {}
    with phases.phase(f"writing {output_dir}"):
        if len(hf_configs) == 1 and loaded[0].meta.get("hf_config") is not None:
            extra["hf_config"] = loaded[0].meta["hf_config"]
            src = os.path.join(directories[0], "hf")
            if os.path.isdir(src):
                shutil.copytree(src, os.path.join(output_dir, "hf"), dirs_exist_ok=True)
        write_checkpoint(output_dir, params, loaded[0].model_cfg, extra_meta=extra)
    summary = {"method": method, "checkpoints": [c.directory for c in loaded],
               "steps": [c.step for c in loaded], "weights": weights,
               "base": base_ck.directory if base_ck else None,
               "parameters": int(sum(np.size(x) for x in jax.tree.leaves(params)))}
    with open(os.path.join(output_dir, "merge.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    return summary


def _parse_weights(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"--weights={text!r} is not a comma-separated list of numbers") from e


EXAMPLES = """examples:
  python -m hcjax.distill.merge --checkpoint runs/long --checkpoint runs/short --output_dir runs/merged
  python -m hcjax.distill.merge --checkpoint runs/a --checkpoint runs/b --weights 0.7,0.3 --output_dir OUT
  python -m hcjax.distill.merge --base runs/sft --checkpoint runs/add --checkpoint runs/sub \\
      --weights 1,1 --output_dir runs/task_vectors   # base + Σ λ_i (θ_i − base)
"""


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """`python -m hcjax.distill.merge --checkpoint A --checkpoint B [--weights 0.5,0.5]
    [--base BASE] --output_dir OUT [--gin_file F] [--gin_param B]`."""
    from hcjax import config

    def extra(parser):
        parser.add_argument("--checkpoint", action="append", required=True,
                            help="an hcjax run (sft, climb, merge, convert) or its checkpoints/ "
                            "folder (repeatable; its latest step)")
        parser.add_argument("--weights", default=None,
                            help="comma-separated weights, one per --checkpoint (default equal); "
                            "with --base, the task-vector coefficients λ_i")
        parser.add_argument("--base", default=None,
                            help="the common base: merge by task vectors base + Σ λ_i (θ_i − base)")

    def extra_with_examples(parser):
        extra(parser)
        config.set_examples(parser, EXAMPLES)

    flags = config.parse_flags(argv, description=__doc__.splitlines()[0],
                               extra_args=extra_with_examples)
    config.bind(flags.gin_files, flags.gin_params)
    if not flags.output_dir:
        raise config.ConfigError("--output_dir is required")
    args = flags.extra
    weights = _parse_weights(args.weights)
    config.write_config(flags.output_dir, flags)
    summary = merge_checkpoints(args.checkpoint, flags.output_dir, weights=weights,
                                base=args.base, phases=Phases("hcjax.distill.merge"))
    config.write_operative_config(flags.output_dir)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)
