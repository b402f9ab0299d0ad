"""HF checkpoints: logits parity with transformers' Qwen3/Qwen2, save/load round trips, errors.

transformers + torch (CPU) are test references only; they never run in the product.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec
from safetensors.numpy import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from rl.model import jit_forward, load_hf, make_mesh, save_hf
from rl.model.config import MeshConfig

# Tiny configs covering: GQA ratios 1/2/3/4, head_dim != D / N, tied and untied heads.
QWEN3_CONFIGS = {
    "gqa2-untied-headdim16": dict(
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
        tie_word_embeddings=False,
    ),
    "gqa3-tied-headdim8": dict(
        hidden_size=64,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    ),
    "mqa-untied-headdim32": dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=False,
    ),
    "mha-tied-bias": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        tie_word_embeddings=True,
        attention_bias=True,
    ),
}


def _hf_qwen3(seed: int, **fields) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=301,
        intermediate_size=80,
        num_hidden_layers=3,
        rope_theta=50_000.0,  # not a default anywhere: a misread base would show
        max_position_embeddings=512,
        **fields,
    )
    model = Qwen3ForCausalLM(cfg).float().eval()
    _randomise_norms(model, seed)
    return model


def _randomise_norms(model: torch.nn.Module, seed: int) -> None:
    """Norm weights init to ones and biases to zeros; perturb them so the test sees them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def _tokens(vocab: int, shape=(2, 23), seed=0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab, shape)


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def _max_abs(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


@pytest.mark.parametrize("name", sorted(QWEN3_CONFIGS))
def test_logits_match_transformers_qwen3(tmp_path, name):
    hf = _hf_qwen3(seed=len(name), **QWEN3_CONFIGS[name])
    hf.save_pretrained(tmp_path)
    cfg, model = load_hf(tmp_path)
    assert cfg.num_layers == 3 and cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    tokens = _tokens(cfg.vocab_size)
    ours = jit_forward(model)(jnp.asarray(tokens))
    assert ours.dtype == jnp.float32
    assert _max_abs(ours, _hf_logits(hf, tokens)) < 1e-4


def test_logits_match_transformers_qwen2(tmp_path):
    torch.manual_seed(7)
    hf_cfg = Qwen2Config(
        vocab_size=257,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        rope_theta=20_000.0,
        tie_word_embeddings=False,
    )
    hf = Qwen2ForCausalLM(hf_cfg).float().eval()
    _randomise_norms(hf, 7)
    hf.save_pretrained(tmp_path)
    cfg, model = load_hf(tmp_path)
    assert not cfg.qk_norm and cfg.qkv_bias and not cfg.o_bias
    tokens = _tokens(cfg.vocab_size)
    assert _max_abs(jit_forward(model)(jnp.asarray(tokens)), _hf_logits(hf, tokens)) < 1e-4


def test_save_load_round_trip_is_exact_and_transformers_loads_it(tmp_path):
    hf = _hf_qwen3(seed=1, **QWEN3_CONFIGS["gqa2-untied-headdim16"])
    hf.save_pretrained(tmp_path / "orig")
    cfg, model = load_hf(tmp_path / "orig")

    save_hf(cfg, model, tmp_path / "ours")
    cfg2, model2 = load_hf(tmp_path / "ours")
    assert cfg2 == cfg
    for (p1, v1), (p2, v2) in zip(
        nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(model2)), strict=True
    ):
        assert p1 == p2
        np.testing.assert_array_equal(np.asarray(v1.get_value()), np.asarray(v2.get_value()))

    # Tensor for tensor what transformers wrote, and transformers reads it back.
    orig = load_file(tmp_path / "orig" / "model.safetensors")
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    assert set(ours) == set(orig)
    for name in orig:
        np.testing.assert_array_equal(ours[name], orig[name])
    reloaded = Qwen3ForCausalLM.from_pretrained(tmp_path / "ours").float().eval()
    tokens = _tokens(cfg.vocab_size)
    np.testing.assert_array_equal(_hf_logits(reloaded, tokens), _hf_logits(hf, tokens))


def test_sharded_checkpoint_with_index_round_trips(tmp_path):
    hf = _hf_qwen3(seed=2, **QWEN3_CONFIGS["gqa3-tied-headdim8"])
    hf.save_pretrained(tmp_path / "orig")
    cfg, model = load_hf(tmp_path / "orig")
    save_hf(cfg, model, tmp_path / "sharded", max_shard_bytes=20_000)
    files = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    reloaded = Qwen3ForCausalLM.from_pretrained(tmp_path / "sharded").float().eval()
    tokens = _tokens(cfg.vocab_size)
    np.testing.assert_array_equal(_hf_logits(reloaded, tokens), _hf_logits(hf, tokens))
    _, model2 = load_hf(tmp_path / "sharded")
    forward = jit_forward(model)
    np.testing.assert_array_equal(forward(tokens), jit_forward(model2)(tokens))


def test_bfloat16_checkpoint_loads_and_saves_as_bfloat16(tmp_path):
    hf = _hf_qwen3(seed=3, **QWEN3_CONFIGS["gqa3-tied-headdim8"]).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "bf16")
    cfg, model = load_hf(tmp_path / "bf16")
    assert cfg.param_dtype == "bfloat16" and model.embed.get_value().dtype == jnp.bfloat16
    save_hf(cfg, model, tmp_path / "out")
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert all(str(t.dtype) == "bfloat16" for t in tensors.values())
    _, f32 = load_hf(tmp_path / "bf16", dtype="float32")
    assert f32.embed.get_value().dtype == jnp.float32


def test_load_onto_a_mesh_shards_parameters(tmp_path):
    hf = _hf_qwen3(seed=4, **QWEN3_CONFIGS["mha-tied-bias"])
    hf.save_pretrained(tmp_path)
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=4))
    cfg, model = load_hf(tmp_path, mesh=mesh)
    q = model.layers.attn.q.get_value()  # [L, D, N, H]: embed->fsdp, q_heads->tensor
    assert q.sharding.spec == PartitionSpec(None, "fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (3, 32, 1, 16)
    tokens = _tokens(cfg.vocab_size)
    assert _max_abs(jit_forward(model)(jnp.asarray(tokens)), _hf_logits(hf, tokens)) < 1e-4


# ----- errors -------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path):
    _hf_qwen3(seed=5, **QWEN3_CONFIGS["gqa3-tied-headdim8"]).save_pretrained(tmp_path)
    return tmp_path


def test_missing_tensor_is_named(checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf(checkpoint)


def test_shape_mismatch_is_named(checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"k_proj\.weight: shape \(8, 64\).*\(16, 64\)"):
        load_hf(checkpoint)


def test_unsupported_architecture_is_refused(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_hf(checkpoint)


def test_unexpected_tensor_is_refused(checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.layers.0.self_attn.extra.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"does not use.*extra\.weight"):
        load_hf(checkpoint)


def test_missing_directory_contents_are_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(tmp_path)
    hf_cfg = Qwen3Config(vocab_size=10, architectures=["Qwen3ForCausalLM"])
    (tmp_path / "config.json").write_text(hf_cfg.to_json_string())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf(tmp_path)
