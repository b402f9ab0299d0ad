"""Sharding: a (2, 4) fake-device mesh gives the unsharded numbers, placed as the rules say."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from rl.model import Qwen3, jit_decode, jit_forward, make_mesh, shard_model, tiny, use_mesh
from rl.model.config import DEFAULT_RULES, MeshConfig, ShardingConfig
from rl.model.sharding import constrain, logical_to_spec, partition_specs

# Every dim divisible by fsdp=2 / tensor=4, so each rule really splits its dim.
CFG = tiny(
    hidden_size=64,
    num_heads=8,
    num_kv_heads=4,
    head_dim=8,
    intermediate_size=128,
    vocab_size=512,
    tie_word_embeddings=False,
)


def _spec(x: jax.Array) -> tuple:
    """The array's PartitionSpec padded to its rank (JAX may drop trailing Nones)."""
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def test_eight_fake_devices_are_present():
    assert len(jax.devices()) == 8


def test_sharded_forward_and_decode_equal_unsharded():
    tokens = jax.random.randint(jax.random.key(0), (4, 16), 0, CFG.vocab_size)
    plain = Qwen3(CFG, rngs=nnx.Rngs(0))
    want_BTV = jit_forward(plain)(tokens)
    want_dec, _ = jit_decode(plain)(tokens, plain.init_cache(4, 32))

    mesh = make_mesh(MeshConfig(fsdp=2, tensor=4))
    with use_mesh(mesh, ShardingConfig().rules):
        model = shard_model(Qwen3(CFG, rngs=nnx.Rngs(0)), mesh)
        got_BTV = jit_forward(model)(tokens)
        cache = model.init_cache(4, 32)
        got_dec, cache = jit_decode(model)(tokens, cache)

    np.testing.assert_allclose(got_BTV, want_BTV, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_dec, want_dec, atol=1e-5, rtol=0)
    assert _spec(got_BTV) == ("fsdp", None, "tensor")  # activation rules applied
    assert _spec(cache.k) == (None, "fsdp", None, "tensor", None)


def test_parameters_are_placed_as_the_rules_say():
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=4))
    model = shard_model(Qwen3(CFG, rngs=nnx.Rngs(0)), mesh)
    specs = partition_specs(model)
    assert specs["embed"] == PartitionSpec("tensor", "fsdp")  # vocab, embed
    assert specs["lm_head"] == PartitionSpec("fsdp", "tensor")  # embed, vocab
    assert specs["layers/attn/q"] == PartitionSpec(None, "fsdp", "tensor", None)
    assert specs["layers/attn/k"] == PartitionSpec(None, "fsdp", "tensor", None)
    assert specs["layers/attn/o"] == PartitionSpec(None, "tensor", None, "fsdp")
    assert specs["layers/mlp/gate"] == PartitionSpec(None, "fsdp", "tensor")
    assert specs["layers/mlp/down"] == PartitionSpec(None, "tensor", "fsdp")
    assert specs["layers/attn_norm/weight"] == PartitionSpec(None, None)
    # Each device really holds only its slice: [L, D/2, F/4].
    gate = model.layers.mlp.gate.get_value()
    assert {s.data.shape for s in gate.addressable_shards} == {(2, 32, 32)}


def test_rules_table_from_config_changes_placement():
    mesh = make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
    rules = ShardingConfig(rules={"mlp": ["fsdp"], "embed": []}).rules
    model = shard_model(Qwen3(CFG, rngs=nnx.Rngs(0)), mesh, rules)
    assert partition_specs(model)["layers/mlp/gate"] == PartitionSpec(None, None, "fsdp")


def test_indivisible_dims_fall_back_to_replicated():
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=4))
    # 2 kv heads cannot split 4 ways: replicated on tensor, embed still on fsdp.
    spec = logical_to_spec(
        ("embed", "kv_heads", "head_dim"), DEFAULT_RULES, shape=(64, 2, 8), mesh=mesh
    )
    assert spec == PartitionSpec("fsdp", None, None)
    # A mesh axis is used once per array even if two dims ask for it.
    assert logical_to_spec(("mlp", "q_heads")) == PartitionSpec("tensor", None)


def test_constrain_is_identity_without_a_mesh():
    x = jnp.ones((4, 8))
    assert constrain(x, ("act_batch", "act_embed")) is x


def test_bad_mesh_and_rules_are_rejected():
    with pytest.raises(ValueError, match="needs 6 devices, got 8"):
        make_mesh(MeshConfig(fsdp=2, tensor=3))
    with pytest.raises(ValueError, match=r"rules\['embed'\]=\['model'\]"):
        ShardingConfig(rules={"embed": ["model"]})
    with pytest.raises(ValueError, match="MeshConfig.tensor=0"):
        MeshConfig(tensor=0)
