"""Disjoint named sub-meshes per role, and how batches are placed on them.

    meshes = role_meshes({"policy_train": MeshConfig(fsdp=4), "sim_train": MeshConfig(fsdp=2)})

Devices are handed out in order, one contiguous block per role, like the TPU chip plan does
with chips of a host (`simloop plan-chips`); on CPU the same plan runs over the fake devices
of `--xla_force_host_platform_device_count`. A role may also be given explicit device ids
(from a chip plan) instead of taking the next free ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rl.model.config import MeshConfig
from rl.model.sharding import make_mesh

BATCH_AXES = ("data", "fsdp")


def split_devices(
    sizes: Mapping[str, int],
    devices: Sequence[jax.Device] | None = None,
    *,
    device_ids: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, list[jax.Device]]:
    """`{role: devices}`: explicit `device_ids[role]` where given, else the next free block
    of `sizes[role]` devices. Raises ValueError on overlap or when devices run out."""
    devices = list(jax.devices() if devices is None else devices)
    by_id = {d.id: d for d in devices}
    device_ids = dict(device_ids or {})
    taken: dict[int, str] = {}
    out: dict[str, list[jax.Device]] = {}
    for role, ids in device_ids.items():
        if len(ids) != sizes.get(role, len(ids)):
            raise ValueError(f"role {role!r}: {len(ids)} device ids for a mesh of {sizes[role]}")
        for i in ids:
            if i not in by_id:
                raise ValueError(
                    f"role {role!r}: device id {i} does not exist (have {sorted(by_id)})"
                )
            if i in taken:
                raise ValueError(f"device {i} is given to both {taken[i]!r} and {role!r}")
            taken[i] = role
        out[role] = [by_id[i] for i in ids]
    free = [d for d in devices if d.id not in taken]
    for role, n in sizes.items():
        if role in out:
            continue
        if n > len(free):
            want = sum(sizes.values())
            raise ValueError(
                f"role {role!r} needs {n} devices but only {len(free)} are left: the roles ask "
                f"for {dict(sizes)} = {want} devices and this process has {len(devices)}; "
                "shrink a role's mesh or run on more devices"
            )
        out[role], free = free[:n], free[n:]
    return out


def role_meshes(
    roles: Mapping[str, MeshConfig],
    devices: Sequence[jax.Device] | None = None,
    *,
    device_ids: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, Mesh]:
    """A `(data, fsdp, tensor)` mesh per role over disjoint devices."""
    split = split_devices({r: m.size for r, m in roles.items()}, devices, device_ids=device_ids)
    return {role: make_mesh(roles[role], split[role]) for role in roles}


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[B, T] arrays: rows split over the data-parallel axes, sequence whole."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, None))


def data_parallel_size(mesh: Mesh) -> int:
    return int(mesh.shape["data"] * mesh.shape["fsdp"])
