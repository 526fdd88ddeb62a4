"""Model merging (Kimi k1.5 long2short, RECIPE §5): the weighted average of two or more checkpoints
of one architecture, and task-vector arithmetic base + Σ λ_i (ft_i − base).

`merge_checkpoints` reads any hcjax runs and writes the result as a run folder in the hcjax.sft
layout (hcjax.model_io), so it is a `--base_checkpoint` of the climb and a
`TrainerConfig.init_checkpoint`; `python -m hcjax.merge` is its command line. The maths are pure
functions of param trees; no training here.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hcjax.display import Phases
from hcjax.model_io import RunCheckpoint, read_checkpoint, write_checkpoint

__all__ = [
    "check_same_architecture",
    "check_same_tree",
    "merge_checkpoints",
    "task_arithmetic",
    "weighted_average",
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
def check_same_architecture(checkpoints: Sequence[RunCheckpoint]) -> None:
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
    phases = phases or Phases("hcjax.merge", mode="off")
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
        # One checkpoint, no base: its latest params alone, re-written in the sft layout (e.g. a
        # climb's, without its optimiser state and earlier steps).
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
