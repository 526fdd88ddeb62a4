"""Meshes from configuration, and the one table that maps logical axis names to mesh axes.

A mesh is described by `MeshConfig` (axis sizes plus the slice of `jax.devices()` it uses), so a
learner mesh and an inference mesh can live on disjoint devices of one process (`Placement`
checks that they do). Parameters carry logical axis names (e.g. ("embed", "mlp"));
`logical_to_spec` turns them into a `PartitionSpec` through `LOGICAL_RULES`. Activations inside the model are constrained by logical names too
(`constrain`), against the mesh the caller put in context with `jax.set_mesh(mesh)`; with no mesh in
context that is a no-op. This module must not hard-code device counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import gin
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# Logical axis -> mesh axis (or tuple of mesh axes, or None for replicated). One table for the
# whole model, as in MaxText's logical axis rules.
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    # The model width of every weight: over fsdp and, where experts are split over the expert
    # axis, over that axis too. Outside the MoE the expert axis is one more data-parallel axis
    # (activation_batch below), so it splits nothing of the attention, embedding, head or router
    # compute: their weights and AdamW moments are stored 64 ways on fsdp 4 x tensor 4 x expert
    # 4 instead of 16, and gathered per layer like FSDP. Expert weights [E, embed, f] keep
    # expert for E (a mesh axis is used once per array), so their embed is over fsdp only.
    "embed": ("fsdp", "expert"),
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    # LatentMoE's latent width: the expert weights' other axis, so [E, latent, f] is split over
    # expert x fsdp x tensor like plain experts' [E, embed, f] (else they are replicated over fsdp).
    "latent": "fsdp",
    # MLA's low-rank widths: the leading axis of its up-projections [rank, heads, head_dim]
    # (DeepSeek-V3's 1536 x 128 x 192 and 512 x 128 x 256 were stored 8 ways, over tensor only:
    # 1.58 GB a chip of fp32 weights, x3 with AdamW, on v5p:8x8x8). As `embed`: over fsdp x
    # expert, gathered per layer. In the down-projections [embed, rank] embed has them first.
    "q_lora": ("fsdp", "expert"),
    "kv_lora": ("fsdp", "expert"),
    "experts": "expert",
    "expert_mlp": "tensor",
    "router_experts": None,
    "norm": None,
    "layers": None,
    # Activations (`constrain`), MaxText-style: the batch over every data-parallel axis (the expert
    # axis too: outside the MoE it holds its own slice of the batch), the residual stream's width,
    # heads and MLP hidden over the tensor axis, sequence unsharded.
    "activation_batch": ("data", "fsdp", "expert"),
    "activation_length": None,
    "activation_embed": "tensor",
    "activation_heads": "tensor",
    "activation_kv_heads": "tensor",
    "activation_head_dim": None,
    "activation_mlp": "tensor",
    "activation_vocab": "tensor",
}

# The rules of a serving (decode) mesh: the width over fsdp only. A decode step must not gather
# weights every token; the inference mesh has no fsdp (plan.inference_mesh_config) but keeps the
# learner's expert axis, which under LOGICAL_RULES would split every non-expert weight.
SERVING_RULES: dict[str, str | tuple[str, ...] | None] = dict(
    LOGICAL_RULES, embed="fsdp", q_lora="fsdp", kv_lora="fsdp")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """A named device mesh over devices [device_offset, device_offset + product(sizes)).

    A size of -1 on at most one axis means "all remaining devices" (of `num_devices`, or of every
    device after `device_offset` when num_devices is None).
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    expert: int = 1
    device_offset: int = 0
    num_devices: int | None = None

    def sizes(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor, "expert": self.expert}


def make_mesh(config: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build a `Mesh` with axes (data, fsdp, tensor, expert) from `config`; errors name bad sizes."""
    config = config or MeshConfig()
    all_devices = list(devices) if devices is not None else jax.devices()
    if config.device_offset < 0 or config.device_offset >= len(all_devices):
        raise ValueError(
            f"MeshConfig.device_offset={config.device_offset} is outside the "
            f"{len(all_devices)} available devices"
        )
    available = all_devices[config.device_offset :]
    if config.num_devices is not None:
        if config.num_devices <= 0 or config.num_devices > len(available):
            raise ValueError(
                f"MeshConfig.num_devices={config.num_devices} is not in [1, {len(available)}] "
                f"(devices after offset {config.device_offset})"
            )
        available = available[: config.num_devices]
    sizes = config.sizes()
    for name, size in sizes.items():
        if size == 0 or size < -1:
            raise ValueError(f"mesh axis {name}={size} must be positive or -1 (fill)")
    fill = [n for n, s in sizes.items() if s == -1]
    if len(fill) > 1:
        raise ValueError(f"at most one mesh axis may be -1 (fill), got {fill}")
    fixed = int(np.prod([s for s in sizes.values() if s != -1]))
    if fill:
        n = len(available)
        if n % fixed:
            raise ValueError(
                f"mesh axes {sizes} do not divide the {n} available devices "
                f"(the fixed axes multiply to {fixed})"
            )
        sizes[fill[0]] = n // fixed
    total = int(np.prod(list(sizes.values())))
    if config.num_devices is not None and total != config.num_devices:
        raise ValueError(
            f"mesh axes {sizes} multiply to {total}, not MeshConfig.num_devices={config.num_devices}"
        )
    if total > len(available):
        raise ValueError(
            f"mesh axes {sizes} need {total} devices but only {len(available)} are available "
            f"from device_offset={config.device_offset}"
        )
    grid = np.array(available[:total], dtype=object).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES)


def logical_to_spec(
    logical_axes: Sequence[str | None] | None,
    rules: Mapping[str, str | tuple[str, ...] | None] | None = None,
) -> PartitionSpec:
    """Map logical axis names to a PartitionSpec; a mesh axis is used at most once per array."""
    rules = LOGICAL_RULES if rules is None else rules
    if logical_axes is None:
        return PartitionSpec()
    used: set[str] = set()
    out = []
    for name in logical_axes:
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise ValueError(f"logical axis {name!r} has no rule (known: {sorted(rules)})")
        target = rules[name]
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        targets = tuple(t for t in targets if t not in used)
        used.update(targets)
        out.append(None if not targets else targets[0] if len(targets) == 1 else targets)
    return PartitionSpec(*out)


def check_divisible(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh, what: str) -> None:
    """Raise a clear error when a dimension is not divisible by the mesh axes it is sharded over."""
    for dim, (size, axes) in enumerate(zip(shape, tuple(spec) + (None,) * len(shape))):
        if axes is None:
            continue
        axes_t = (axes,) if isinstance(axes, str) else tuple(axes)
        n = int(np.prod([mesh.shape[a] for a in axes_t]))
        if size % n:
            raise ValueError(
                f"{what}: dimension {dim} of shape {tuple(shape)} has size {size}, not divisible "
                f"by mesh axes {axes_t} of total size {n}"
            )


def named_sharding(
    mesh: Mesh,
    logical_axes: Sequence[str | None] | None,
    shape: Sequence[int] | None = None,
    rules: Mapping[str, str | tuple[str, ...] | None] | None = None,
    what: str = "array",
) -> NamedSharding:
    spec = logical_to_spec(logical_axes, rules)
    if shape is not None:
        check_divisible(shape, spec, mesh, what)
    return NamedSharding(mesh, spec)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding for [batch, ...] arrays: batch over (data, fsdp), the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (ndim - 1))))


def replicated_scalar(value, mesh: Mesh) -> jax.Array:
    """A scalar on every device of `mesh`, each process writing its own devices' copies: no
    collective, and right when the mesh spans several processes (where `jax.device_put` of a
    committed one-device array onto the mesh builds a malformed global array in jax 0.10)."""
    return jax.make_array_from_callback(
        (), NamedSharding(mesh, PartitionSpec()), lambda _: np.asarray(value))


def optimizer_state_on_mesh(tx, params, mesh: Mesh):
    """`tx.init(params)` born on the mesh: moments sharded like their parameters, every other
    leaf (counts, schedules) replicated. Left to itself, jit puts outputs that never read their
    inputs' values (zero moments, counts) on one default device."""
    replicated = NamedSharding(mesh, PartitionSpec())
    shardings = optax.tree_map_params(
        tx, lambda _, p: p.sharding, jax.eval_shape(tx.init, params), params,
        transform_non_params=lambda _: replicated)
    return jax.jit(tx.init, out_shardings=shardings)(params)


def constrain(x: jax.Array, logical_axes: Sequence[str | None], rules: Mapping | None = None):
    """`with_sharding_constraint` of `x` by logical axis names on the context mesh.

    The mesh reaches the model through JAX's context: trace it under `with jax.set_mesh(mesh):`
    (or `jax.sharding.use_mesh`). With no mesh in context this returns `x` unchanged, so CPU tests
    without a mesh run exactly as before. Only the mesh's Auto axes are used (not Manual axes
    inside a `shard_map`, not Explicit ones), and a dimension keeps only the leading mesh axes
    whose product divides it (a batch of 1 in decode stays unsharded instead of failing).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.auto_axes:
        return x
    return jax.lax.with_sharding_constraint(x, activation_spec(x.shape, logical_axes, mesh, rules))


def activation_spec(shape: Sequence[int], logical_axes: Sequence[str | None], mesh,
                    rules: Mapping | None = None) -> PartitionSpec:
    """The PartitionSpec `constrain` gives an activation of `shape` on `mesh`: each dimension keeps
    the leading Auto mesh axes of its rule whose product divides it."""
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    auto = set(mesh.auto_axes)
    spec = []
    for size, entry in zip(shape, logical_to_spec(logical_axes, rules)):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept: list[str] = []
        for axis in (a for a in axes if a in auto and mesh.shape[a] > 1):
            if size % (int(np.prod([mesh.shape[a] for a in kept])) * mesh.shape[axis]):
                break
            kept.append(axis)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*spec)
