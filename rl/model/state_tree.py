"""An nnx State as a pure dict and back, built from pytree paths.

flax 0.12's `nnx.merge`, `State.filter`, `nnx.to_pure_dict` and `nnx.replace_by_pure_dict`
each leave a reference cycle behind (a recursive flattening closure over the flat state). A
server that swaps its weights every RL step would then hold each replaced version, and on a
CPU device the host buffers its arrays alias (`rl.model.zarr_read`), until the cyclic GC
happens to run. These two do the same through `jax.tree_util` and leave nothing behind.

    params = pure_dict(state)             # {"embed": array, "layers": {...}, ...}
    state = with_values(state, params)    # a fresh State: new Variables, the same metadata
"""

from __future__ import annotations

from typing import Any

import jax


def _keys(path: tuple) -> list:
    """The mapping keys of a state leaf's pytree path (its Variable's `.value` dropped)."""
    return [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]


def pure_dict(state: Any) -> dict:
    """`nnx.to_pure_dict(state)` for a State of Variables held in mappings."""
    out: dict = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        *parents, last = _keys(path)
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = x
    return out


def with_values(state: Any, values: dict) -> Any:
    """A copy of `state` whose leaves are the arrays at the same keys of `values` (a pure
    dict like `pure_dict(state)`'s); KeyError names a key `values` lacks."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    new = []
    for path, _ in leaves:
        node = values
        for key in _keys(path):
            node = node[key]
        new.append(node)
    return jax.tree_util.tree_unflatten(treedef, new)
