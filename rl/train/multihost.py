"""What a trainer does differently when it is one of several JAX processes (multi-controller:
one process per host of a pod slice, or several local processes on CPU).

    if is_primary():
        write_the_run_files()
    barrier("manifest written")            # every process waits here for the others

Every process runs the same program over the global mesh: it builds the same (deterministic)
global batch and places only the rows its own devices hold (`Trainer.device_batch`), calls
Orbax's save and restore together with the others, and leaves the files of the run directory
(metrics, manifests, reports, weights' sidecars) to process 0. With one process every helper
here is a no-op. How the processes are started and connected is `launch/distributed.py`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def process_count() -> int:
    return jax.process_count()


def process_index() -> int:
    return jax.process_index()


def is_primary() -> bool:
    """Whether this process writes the run's shared files (process 0)."""
    return jax.process_index() == 0


_BARRIERS = itertools.count()


def barrier(name: str, timeout_s: float = 1800.0) -> None:
    """Wait until every process has reached the barrier `name` (no-op with one process), at
    most `timeout_s` (then this process fails with the runtime's DEADLINE_EXCEEDED). A process
    that died never arrives: the distributed runtime's heartbeat ends the others sooner
    (`launch/distributed.py`), so a job never hangs here. Control only: device work already
    dispatched is not waited for."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed

    key = f"{name}#{next(_BARRIERS)}"  # every process passes its barriers in the same order
    client = distributed.global_state.client
    if client is None:  # not started by jax.distributed (e.g. a TPU runtime of its own)
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(key)
        return
    client.wait_at_barrier(key, int(timeout_s * 1000))


def devices_at(indices: Sequence[int]) -> list[jax.Device]:
    """The global devices at `indices` of `jax.devices()` (a chip plan numbers the devices of
    the whole slice 0..N-1 in process order; JAX's own ids are not contiguous across
    processes: on CPU the second process's start at 2048)."""
    devices = jax.devices()
    out = []
    for i in indices:
        if not 0 <= i < len(devices):
            raise ValueError(
                f"device index {i} does not exist: the job's {jax.process_count()} process(es) "
                f"hold {len(devices)} devices (0..{len(devices) - 1})"
            )
        out.append(devices[i])
    return out


def fetch(tree: Any) -> Any:
    """`jax.device_get` that also reads arrays spanning other processes' devices: a replicated
    one from this process's own copy, any other gathered from all processes (a collective:
    every process must call it). One process: exactly `jax.device_get`."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if x.is_fully_replicated:
                return np.asarray(x.addressable_data(0))
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)

    return jax.tree.map(one, tree)


def broadcast(tree: Any, *, name: str, timeout_s: float) -> Any:
    """Process 0's `tree` of numpy arrays, on every process (a collective: every process
    calls it, the others with a tree of the same shapes and dtypes, whose values are ignored).
    First a barrier of at most `timeout_s`: process 0 may take long to have the tree (episodes
    to run, an evaluation first), and a control-plane wait has a bound of its own where a
    device collective's may not. One process: `tree` itself."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    barrier(name, timeout_s)
    out = multihost_utils.broadcast_one_to_all(tree)
    return jax.tree.map(np.asarray, out)
