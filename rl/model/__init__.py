"""The Qwen3-family decoder: config and presets (no JAX), the Flax NNX model, KV cache,
logical-axis sharding, HF safetensors load/save, and the one loader of a role's model
(`ModelSource`, for servers and trainers alike).

`from rl.model import ModelConfig, Qwen3, load_hf, save_hf`. Attributes are resolved lazily so
that `rl.model.config` (and with it config validation) never imports JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelConfig": "rl.model.config",
    "MeshConfig": "rl.model.config",
    "ShardingConfig": "rl.model.config",
    "PRESETS": "rl.model.config",
    "preset": "rl.model.config",
    "tiny": "rl.model.config",
    "qwen3_0p6b": "rl.model.config",
    "qwen3_1p7b": "rl.model.config",
    "qwen3_4b": "rl.model.config",
    "qwen3_8b": "rl.model.config",
    "Qwen3": "rl.model.transformer",
    "KVCache": "rl.model.transformer",
    "jit_forward": "rl.model.transformer",
    "jit_decode": "rl.model.transformer",
    "with_dtype": "rl.model.transformer",
    "load_hf": "rl.model.hf_io",
    "save_hf": "rl.model.hf_io",
    "ModelSource": "rl.model.loading",
    "make_mesh": "rl.model.sharding",
    "shard_model": "rl.model.sharding",
    "use_mesh": "rl.model.sharding",
    "constrain": "rl.model.sharding",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rl.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
