"""`rl.model.state_tree` converts like flax's own `to_pure_dict` / `replace_by_pure_dict`,
and leaves no reference cycle holding the arrays it touched."""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl.model import Qwen3
from rl.model.config import tiny
from rl.model.state_tree import pure_dict, with_values


def _state():
    return nnx.split(Qwen3(tiny(), rngs=nnx.Rngs(0)))[1]


def test_pure_dict_and_with_values_match_flax():
    state = _state()
    mine, theirs = pure_dict(state), nnx.to_pure_dict(state)
    assert jax.tree.structure(mine) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs), strict=True):
        assert a is b
    doubled = jax.tree.map(lambda x: x * 2, mine)
    expected = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(expected, doubled)
    got = with_values(state, doubled)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    assert jax.tree.leaves(state)[0] is not jax.tree.leaves(got)[0]  # a copy, not in place
    with pytest.raises(KeyError):
        with_values(state, {k: v for k, v in doubled.items() if k != "embed"})


def test_nothing_is_kept_alive_without_the_cyclic_gc():
    state = _state()
    gc.collect()
    gc.disable()
    try:
        fresh = jax.tree.map(lambda x: jnp.array(x) + 1, pure_dict(state))
        refs = [weakref.ref(x) for x in jax.tree.leaves(fresh)]
        swapped = with_values(state, fresh)
        pure_dict(swapped)
        del fresh, swapped
        assert all(r() is None for r in refs)
    finally:
        gc.enable()
