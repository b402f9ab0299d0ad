"""Hugging Face checkpoints: `load_hf(dir) -> (config, model)` and `save_hf(config, model, dir)`.

Reads and writes the layout transformers and vLLM use for Qwen3/Qwen2: `config.json` plus
`model.safetensors`, or several shards with `model.safetensors.index.json`. HF stores linear
weights as [out, in]; simloop keeps [in, out] kernels with heads split out, and stacks the
per-layer tensors along a leading `layers` axis. The table below is the whole translation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from rl.model.config import ModelConfig
from rl.model.sharding import Rules, state_shardings
from rl.model.transformer import Qwen3

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class _Tensor:
    """One HF tensor <-> one simloop parameter (per layer when `per_layer`)."""

    hf_name: str  # with `{i}` for the layer index
    path: tuple[str, ...]  # simloop state path
    to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray]
    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]
    per_layer: bool = True


def _same(w, _cfg):
    return w


def _transpose(w, _cfg):
    return w.T


def _in_heads(heads_attr: str):
    """[heads*H, D] (HF) <-> [D, heads, H] (ours)."""

    def to_ours(w, cfg):
        return w.T.reshape(cfg.hidden_size, getattr(cfg, heads_attr), cfg.head_dim)

    def to_hf(w, cfg):
        return w.reshape(cfg.hidden_size, -1).T

    return to_ours, to_hf


def _bias_heads(heads_attr: str):
    def to_ours(b, cfg):
        return b.reshape(getattr(cfg, heads_attr), cfg.head_dim)

    def to_hf(b, _cfg):
        return b.reshape(-1)

    return to_ours, to_hf


def _o_to_ours(w, cfg):  # [D, N*H] -> [N, H, D]
    return w.T.reshape(cfg.num_heads, cfg.head_dim, cfg.hidden_size)


def _o_to_hf(w, cfg):
    return w.reshape(-1, cfg.hidden_size).T


def tensor_table(cfg: ModelConfig) -> list[_Tensor]:
    """Every HF tensor of `cfg` with its simloop parameter path and layout converters (what
    `save_hf` / `load_hf` walk, and what the vLLM worker extension maps names with)."""
    attn = "model.layers.{i}.self_attn."
    table = [
        _Tensor("model.embed_tokens.weight", ("embed",), _same, _same, per_layer=False),
        _Tensor("model.norm.weight", ("final_norm", "weight"), _same, _same, per_layer=False),
        _Tensor(
            "model.layers.{i}.input_layernorm.weight",
            ("layers", "attn_norm", "weight"),
            _same,
            _same,
        ),
        _Tensor(
            "model.layers.{i}.post_attention_layernorm.weight",
            ("layers", "mlp_norm", "weight"),
            _same,
            _same,
        ),
        _Tensor(attn + "q_proj.weight", ("layers", "attn", "q"), *_in_heads("num_heads")),
        _Tensor(attn + "k_proj.weight", ("layers", "attn", "k"), *_in_heads("num_kv_heads")),
        _Tensor(attn + "v_proj.weight", ("layers", "attn", "v"), *_in_heads("num_kv_heads")),
        _Tensor(attn + "o_proj.weight", ("layers", "attn", "o"), _o_to_ours, _o_to_hf),
        _Tensor(
            "model.layers.{i}.mlp.gate_proj.weight",
            ("layers", "mlp", "gate"),
            _transpose,
            _transpose,
        ),
        _Tensor(
            "model.layers.{i}.mlp.up_proj.weight", ("layers", "mlp", "up"), _transpose, _transpose
        ),
        _Tensor(
            "model.layers.{i}.mlp.down_proj.weight",
            ("layers", "mlp", "down"),
            _transpose,
            _transpose,
        ),
    ]
    if cfg.qkv_bias:
        table += [
            _Tensor(attn + "q_proj.bias", ("layers", "attn", "q_bias"), *_bias_heads("num_heads")),
            _Tensor(
                attn + "k_proj.bias", ("layers", "attn", "k_bias"), *_bias_heads("num_kv_heads")
            ),
            _Tensor(
                attn + "v_proj.bias", ("layers", "attn", "v_bias"), *_bias_heads("num_kv_heads")
            ),
        ]
    if cfg.o_bias:
        table.append(_Tensor(attn + "o_proj.bias", ("layers", "attn", "o_bias"), _same, _same))
    if cfg.qk_norm:
        table += [
            _Tensor(attn + "q_norm.weight", ("layers", "attn", "q_norm", "weight"), _same, _same),
            _Tensor(attn + "k_norm.weight", ("layers", "attn", "k_norm", "weight"), _same, _same),
        ]
    if not cfg.tie_word_embeddings:
        table.append(_Tensor("lm_head.weight", ("lm_head",), _transpose, _transpose, False))
    return table


# Present in some checkpoints, never needed: RoPE buffers, and the LM head of tied models.
def _ignorable(name: str, cfg: ModelConfig) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (
        cfg.tie_word_embeddings and name == "lm_head.weight"
    )


class _Reader:
    """Lazy access to the tensors of a single-file or sharded safetensors checkpoint."""

    def __init__(self, path: Path):
        index = path / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.where = {name: path / file for name, file in weight_map.items()}
        elif (path / SINGLE_FILE).exists():
            with safe_open(path / SINGLE_FILE, framework="numpy") as f:
                self.where = {name: path / SINGLE_FILE for name in f.keys()}
        else:
            raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
        self._open: dict[Path, object] = {}

    def names(self) -> set[str]:
        return set(self.where)

    def get(self, name: str) -> np.ndarray:
        file = self.where[name]
        if file not in self._open:
            if not file.exists():
                raise FileNotFoundError(f"shard {file} named in {INDEX_FILE} is missing")
            self._open[file] = safe_open(file, framework="numpy")
        return self._open[file].get_tensor(name)


def load_hf(
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    mesh: Mesh | None = None,
    rules: Rules | None = None,
) -> tuple[ModelConfig, Qwen3]:
    """Load a local HF directory. `dtype` sets both param and compute dtype (default: the
    checkpoint's). With `mesh`, every parameter is placed sharded as `rules` say, each device
    receiving only its slice."""
    path = Path(path)
    config_file = path / CONFIG_FILE
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file} not found: load_hf needs an HF model directory")
    overrides = {} if dtype is None else {"param_dtype": dtype, "dtype": dtype}
    cfg = ModelConfig.from_hf(json.loads(config_file.read_text()), **overrides)
    reader = _Reader(path)

    table = tensor_table(cfg)
    expected = {
        t.hf_name.format(i=i)
        for t in table
        for i in (range(cfg.num_layers) if t.per_layer else [0])
    }
    available = reader.names()
    missing = sorted(expected - available)
    if missing:
        raise ValueError(
            f"{path}: checkpoint lacks {len(missing)} tensor(s) the config requires, "
            f"e.g. {missing[:5]}"
        )
    unexpected = sorted(n for n in available - expected if not _ignorable(n, cfg))
    if unexpected:
        raise ValueError(
            f"{path}: checkpoint has {len(unexpected)} tensor(s) a {cfg.architecture} with this "
            f"config does not use, e.g. {unexpected[:5]}"
        )

    abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    shardings = dict(nnx.to_flat_state(state_shardings(state, mesh, rules))) if mesh else {}
    param_dtype = jnp.dtype(cfg.param_dtype)

    for t in table:
        var = flat[t.path]
        want = tuple(var.get_value().shape)
        if t.per_layer:
            parts = [_checked(reader, t, i, cfg, want[1:]) for i in range(cfg.num_layers)]
            value = np.stack(parts)
        else:
            value = _checked(reader, t, None, cfg, want)
        value = value.astype(param_dtype)
        if mesh is None:
            placed = jnp.asarray(value)
        else:
            sharding = shardings[t.path]
            placed = jax.make_array_from_callback(
                value.shape, sharding, lambda idx, v=value: v[idx]
            )
        flat[t.path] = var.replace(placed)

    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return cfg, model


def _checked(reader: _Reader, t: _Tensor, i: int | None, cfg: ModelConfig, want) -> np.ndarray:
    name = t.hf_name.format(i=i)
    raw = reader.get(name)
    expected = tuple(t.to_hf(np.zeros(want, np.int8), cfg).shape)
    if tuple(raw.shape) != expected:
        raise ValueError(
            f"tensor {name}: shape {tuple(raw.shape)} does not match the config "
            f"(expected {expected})"
        )
    return t.to_ours(raw, cfg)


def save_hf(
    config: ModelConfig,
    model: Qwen3,
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write `config.json` and safetensors (sharded with an index past `max_shard_bytes`) that
    transformers' `from_pretrained` and vLLM load. `dtype` defaults to the param dtype."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    out_dtype = jnp.dtype(dtype or config.param_dtype)
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    tensors: dict[str, np.ndarray] = {}
    for t in tensor_table(config):
        value = np.asarray(jax.device_get(flat[t.path].get_value())).astype(out_dtype)
        if t.per_layer:
            for i in range(config.num_layers):
                tensors[t.hf_name.format(i=i)] = np.ascontiguousarray(t.to_hf(value[i], config))
        else:
            tensors[t.hf_name] = np.ascontiguousarray(t.to_hf(value, config))

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes

    for stale in [*path.glob("model*.safetensors"), path / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        save_file(shards[0], path / SINGLE_FILE, metadata=metadata)
    else:
        weight_map = {}
        for k, shard in enumerate(shards, start=1):
            file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, path / file, metadata=metadata)
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(a.nbytes for a in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))

    hf_config = config.to_hf(torch_dtype=out_dtype.name)
    (path / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2))
    return path
