"""Hardware checks, run on a TPU VM with `JAX_PLATFORMS=tpu,cpu pytest -m tpu`."""

import jax
import numpy as np
import pytest
from flax import nnx

from rl.model import Qwen3, jit_forward, make_mesh, shard_model, tiny
from rl.model.config import MeshConfig


@pytest.mark.tpu
def test_forward_on_tpu_matches_cpu_and_shards_over_all_chips():
    cfg = tiny(num_heads=8, num_kv_heads=4, head_dim=16)
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (8, 64))
    with jax.default_device(jax.devices("cpu")[0]):
        want = np.asarray(jit_forward(Qwen3(cfg, rngs=nnx.Rngs(0)))(tokens))
    chips = jax.devices("tpu")
    mesh = make_mesh(MeshConfig(fsdp=len(chips)), chips)
    with jax.default_matmul_precision("highest"):
        model = shard_model(Qwen3(cfg, rngs=nnx.Rngs(0)), mesh)
        got = np.asarray(jit_forward(model)(tokens))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
