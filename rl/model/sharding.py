"""Logical-axis sharding: meshes, the rules table, and the one activation-constraint helper.

Every parameter carries `logical_axes` metadata (e.g. `("embed", "mlp")`); activations and the
KV cache name theirs at the call site. `ShardingConfig.rules` maps logical names to mesh axes
(`data`, `fsdp`, `tensor`). Nothing here changes numerics: without an active mesh, `constrain`
is a no-op and the model runs unsharded.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rl.model.config import DEFAULT_RULES, MESH_AXES, MeshConfig

log = logging.getLogger(__name__)

Rules = Mapping[str, Sequence[str]]


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `(data, fsdp, tensor)` mesh over `devices` (default: all of them)."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) != cfg.size:
        raise ValueError(
            f"mesh data={cfg.data} x fsdp={cfg.fsdp} x tensor={cfg.tensor} needs {cfg.size} "
            f"devices, got {len(devices)}"
        )
    return Mesh(np.asarray(devices, dtype=object).reshape(cfg.shape), MESH_AXES)


def logical_to_spec(
    logical_axes: Sequence[str | None],
    rules: Rules | None = None,
    *,
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> PartitionSpec:
    """PartitionSpec for an array whose dims have these logical names.

    A mesh axis is used at most once per array (first dim wins). With `shape` and `mesh`, a
    mesh axis that does not divide its dim is dropped (replicated) and logged, so e.g. 2 KV
    heads stay whole on a 4-way tensor axis instead of failing to place.
    """
    rules = DEFAULT_RULES if rules is None else rules
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for dim, name in enumerate(logical_axes):
        axes = [a for a in (rules.get(name, ()) if name else ()) if a not in used]
        if mesh is not None:
            axes = [a for a in axes if mesh.shape.get(a, 1) > 1]
        if shape is not None and mesh is not None and axes:
            size = int(np.prod([mesh.shape[a] for a in axes]))
            if shape[dim] % size:
                log.info(
                    "dim %d (%s, size %d) not divisible by mesh axes %s (%d): replicated",
                    dim,
                    name,
                    shape[dim],
                    axes,
                    size,
                )
                axes = []
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*spec)


# ----- the active mesh (activation constraints) -----------------------------------------------


@dataclass(frozen=True)
class _Active:
    mesh: Mesh
    rules: Rules


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar(
    "simloop_sharding", default=None
)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules | None = None) -> Iterator[Mesh]:
    """Activate `mesh` + `rules` for `constrain` calls traced inside the block.

    Constraints are baked in at trace time: jit (or first call) a function inside this block.
    """
    token = _ACTIVE.set(_Active(mesh, DEFAULT_RULES if rules is None else rules))
    try:
        yield mesh
    finally:
        _ACTIVE.reset(token)


def active_mesh() -> Mesh | None:
    active = _ACTIVE.get()
    return None if active is None else active.mesh


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` by logical names; the identity when no mesh is active."""
    active = _ACTIVE.get()
    if active is None:
        return x
    if len(logical_axes) != x.ndim:
        raise ValueError(f"constrain: {len(logical_axes)} axis names for a {x.ndim}-d array")
    spec = logical_to_spec(logical_axes, active.rules, shape=x.shape, mesh=active.mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(active.mesh, spec))


# ----- parameters -----------------------------------------------------------------------------


def _is_var(x: object) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules | None = None) -> nnx.State:
    """A pytree like `state` whose leaves are the NamedSharding each variable's axes ask for."""

    def one(var: nnx.Variable) -> NamedSharding:
        axes = getattr(var, "logical_axes", None)
        value = var.get_value() if hasattr(var, "get_value") else var.value
        if axes is None:
            axes = (None,) * np.ndim(value)
        if len(axes) != np.ndim(value):
            raise ValueError(f"logical_axes {axes} do not match shape {np.shape(value)}")
        return NamedSharding(mesh, logical_to_spec(axes, rules, shape=np.shape(value), mesh=mesh))

    return jax.tree.map(one, state, is_leaf=_is_var)


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules | None = None) -> nnx.Module:
    """Place every variable of `model` as the rules say (in place); returns the model."""
    state = nnx.state(model)
    shardings = state_shardings(state, mesh, rules)
    placed = jax.tree.map(
        lambda var, s: var.replace(jax.device_put(var.get_value(), s)),
        state,
        shardings,
        is_leaf=_is_var,
    )
    nnx.update(model, placed)
    return model


def partition_specs(model: nnx.Module) -> dict[str, PartitionSpec]:
    """`{'path/to/param': PartitionSpec}` of how each parameter is actually placed (for tests
    and logs)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value()
        sharding = getattr(value, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        out["/".join(map(str, path))] = spec
    return out
