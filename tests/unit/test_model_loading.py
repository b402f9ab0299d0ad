"""`rl.model.loading`: the one loader servers and trainers share. A role's source follows the
config's precedence (weights, then HF, then the architecture), and every source builds the
parameters it was given, bit for bit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx
from flax.traverse_util import flatten_dict

from rl.model import Qwen3, save_hf, tiny
from rl.model.loading import ModelSource
from rl.model.params_io import save_params


@dataclasses.dataclass
class _Role:  # the fields of a RoleConfig the loader reads
    weights: str | None = None
    hf_path: str | None = None
    model: object = None


def _params(model) -> dict:
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def test_a_role_names_its_source_weights_first_then_hf_then_architecture():
    cfg = tiny()
    assert ModelSource.of_role(_Role("w", "h", cfg)) == ModelSource(weights="w")
    assert ModelSource.of_role(_Role(None, "h", cfg)) == ModelSource(hf_path="h")
    assert ModelSource.of_role(_Role(None, None, cfg)) == ModelSource(architecture=cfg)
    for bad in ({}, {"weights": "w", "hf_path": "h"}):
        with pytest.raises(ValueError, match="exactly one of weights, hf_path, architecture"):
            ModelSource(**bad)


def test_every_source_builds_the_parameters_it_was_given(tmp_path):
    cfg = tiny()
    model = Qwen3(cfg, rngs=nnx.Rngs(3))
    want = _params(model)
    save_params(model, tmp_path / "weights")
    save_hf(cfg, model, tmp_path / "hf")

    served = ModelSource(weights=str(tmp_path / "weights")).build(seed=0)
    _same(_params(served), want)
    _same(_params(ModelSource.of_dir(tmp_path / "hf").build(seed=0)), want)
    # a random init is the seed's, as `Qwen3(cfg, rngs=nnx.Rngs(seed))` draws it
    _same(_params(ModelSource(architecture=cfg).build(seed=3)), want)

    # a trainer gets the HF parameters on the host, and only the architecture of serving
    # weights (it restores them into its own placement)
    arch, host = ModelSource.of_dir(tmp_path / "hf").trainer_start()
    assert arch.num_layers == cfg.num_layers and host is not None
    flat = {k: np.asarray(v) for k, v in flatten_dict(host).items()}
    _same(flat, want)
    assert ModelSource(weights=str(tmp_path / "weights")).trainer_start() == (cfg, None)
    assert ModelSource(architecture=cfg).trainer_start() == (cfg, None)


def test_a_dtype_is_applied_to_every_source(tmp_path):
    cfg = tiny()
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    save_hf(cfg, model, tmp_path / "hf")
    for source in (ModelSource.of_dir(tmp_path / "hf"), ModelSource(architecture=cfg)):
        half = source.build(seed=0, dtype="bfloat16")
        assert (half.cfg.param_dtype, half.cfg.dtype) == ("bfloat16", "bfloat16")
        assert {str(v.dtype) for v in _params(half).values()} == {"bfloat16"}


def test_weights_load_onto_the_default_device_without_a_random_init(tmp_path, monkeypatch):
    """A server under `jax.default_device` gets its weights there, as an eager init put them;
    and no parameter is drawn at random first (only shapes are traced)."""
    import jax

    import rl.model.layers as layers

    model = Qwen3(tiny(), rngs=nnx.Rngs(3))
    save_params(model, tmp_path / "w")
    drawn = []
    real_normal = jax.random.normal

    def normal(key, shape, dtype=float):
        if not isinstance(key, jax.core.Tracer):
            drawn.append(shape)
        return real_normal(key, shape, dtype)

    monkeypatch.setattr(layers.jax.random, "normal", normal)
    device = jax.devices()[-1]
    with jax.default_device(device):
        built = ModelSource(weights=str(tmp_path / "w")).build(seed=0)
    assert drawn == []
    for got, want in zip(
        jax.tree.leaves(nnx.state(built, nnx.Param)),
        jax.tree.leaves(nnx.state(model, nnx.Param)),
        strict=True,
    ):
        assert got.devices() == {device}
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
