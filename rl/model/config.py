"""Model hyper-parameters for the Qwen3 decoder family, and the published presets.

Imports no JAX, so configs can be validated (and `simloop --help` printed) instantly.
`ModelConfig.from_hf` / `to_hf` translate to and from a Hugging Face `config.json`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rl import validate

DTYPES = ("float32", "bfloat16", "float16")

# HF `architectures` values we can load, and the attention-bias layout each implies.
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only transformer of the Qwen3 (or Qwen2/2.5) family."""

    vocab_size: int = 512
    """Rows of the token embedding (may exceed the tokenizer's vocabulary)."""
    hidden_size: int = 64
    """Model width D."""
    intermediate_size: int = 128
    """SwiGLU hidden width F."""
    num_layers: int = 2
    """Number of decoder blocks L."""
    num_heads: int = 4
    """Query heads N."""
    num_kv_heads: int = 2
    """Key/value heads K (grouped-query attention; N must be a multiple of K)."""
    head_dim: int = 16
    """Per-head width H; Qwen3 decouples it from D / N."""
    rope_theta: float = 1_000_000.0
    """RoPE base frequency."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm."""
    qk_norm: bool = True
    """RMSNorm on each query/key head before RoPE (Qwen3); False for Qwen2."""
    qkv_bias: bool = False
    """Bias on the q/k/v projections (Qwen2: True)."""
    o_bias: bool = False
    """Bias on the output projection."""
    tie_word_embeddings: bool = True
    """LM head shares the token embedding matrix."""
    max_position_embeddings: int = 40_960
    """Longest context the positions were trained for (informational; decode caches are sized
    explicitly)."""
    initializer_range: float = 0.02
    """Std-dev of the normal initialiser for fresh weights."""
    param_dtype: str = "float32"
    """Storage dtype of the parameters."""
    dtype: str = "float32"
    """Compute dtype of matmuls; norms, softmax and logits are always float32."""
    architecture: str = "Qwen3ForCausalLM"
    """HF `architectures[0]` written by save_hf."""

    def __post_init__(self) -> None:
        validate.positive_int(
            self,
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        )
        validate.require(
            self.num_heads % self.num_kv_heads == 0,
            self,
            "num_kv_heads",
            f"must divide num_heads={self.num_heads}",
        )
        validate.require(self.head_dim % 2 == 0, self, "head_dim", "must be even (RoPE pairs)")
        validate.positive(self, "rope_theta", "rms_norm_eps", allowed="must be > 0")
        validate.one_of(self, "param_dtype", DTYPES, allowed=f"one of {DTYPES}")
        validate.one_of(self, "dtype", DTYPES, allowed=f"one of {DTYPES}")
        validate.one_of(
            self,
            "architecture",
            SUPPORTED_ARCHITECTURES,
            allowed=f"one of {SUPPORTED_ARCHITECTURES}",
        )

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (G)."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count, embeddings included (the LM head counted once when tied)."""
        d, f, n, k, h = (
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        attn = d * n * h + 2 * d * k * h + n * h * d
        if self.qkv_bias:
            attn += n * h + 2 * k * h
        if self.o_bias:
            attn += d
        if self.qk_norm:
            attn += 2 * h
        block = attn + 3 * d * f + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return embed + self.num_layers * block + d

    # ----- Hugging Face config.json ---------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: dict[str, Any], **overrides: Any) -> ModelConfig:
        """Build from a parsed HF `config.json`; raises ValueError for unsupported models."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json architectures={archs!r} is not supported: "
                f"simloop loads {list(SUPPORTED_ARCHITECTURES)}"
            )
        rope_theta = _hf_rope_theta(hf)
        if hf.get("use_sliding_window") or any(
            t != "full_attention" for t in hf.get("layer_types") or []
        ):
            raise ValueError(
                "config.json asks for sliding-window attention (use_sliding_window / "
                "layer_types): only full attention is implemented"
            )
        num_heads = hf["num_attention_heads"]
        qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(hf.get("attention_bias", False))
        dtype_name = _hf_dtype(hf.get("dtype") or hf.get("torch_dtype"))
        fields: dict[str, Any] = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=rope_theta,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qk_norm=not qwen2,
            qkv_bias=True if qwen2 else attention_bias,
            o_bias=False if qwen2 else attention_bias,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 40_960),
            initializer_range=hf.get("initializer_range", 0.02),
            param_dtype=dtype_name,
            dtype=dtype_name,
            architecture=arch,
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf(self, torch_dtype: str | None = None) -> dict[str, Any]:
        """A `config.json` dict that transformers and vLLM load."""
        qwen2 = self.architecture == "Qwen2ForCausalLM"
        if qwen2 and (self.qk_norm or not self.qkv_bias or self.o_bias):
            raise ValueError(
                "Qwen2ForCausalLM needs qk_norm=False, qkv_bias=True, o_bias=False; "
                f"got qk_norm={self.qk_norm}, qkv_bias={self.qkv_bias}, o_bias={self.o_bias}"
            )
        if not qwen2 and (not self.qk_norm or self.qkv_bias != self.o_bias):
            raise ValueError(
                "Qwen3ForCausalLM needs qk_norm=True and qkv_bias == o_bias (attention_bias); "
                f"got qk_norm={self.qk_norm}, qkv_bias={self.qkv_bias}, o_bias={self.o_bias}"
            )
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "qwen2" if qwen2 else "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "rms_norm_eps": self.rms_norm_eps,
            # Both spellings: transformers >= 5 reads rope_parameters, older readers (and
            # vLLM releases that predate it) read rope_theta.
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_cache": True,
            "use_sliding_window": False,
            "sliding_window": None,
            "attention_dropout": 0.0,
            "torch_dtype": torch_dtype or self.param_dtype,
            "dtype": torch_dtype or self.param_dtype,
        }
        if not qwen2:
            out["attention_bias"] = self.qkv_bias
        return out


def _hf_rope_theta(hf: dict[str, Any]) -> float:
    """RoPE base from either spelling; anything but plain RoPE is refused."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for spec, key in ((params, "rope_parameters"), (scaling, "rope_scaling")):
        rope_type = spec.get("rope_type", spec.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"config.json {key}={spec!r} is not supported: only plain RoPE "
                "(rope_type 'default') is implemented"
            )
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json has no rope_theta (nor rope_parameters.rope_theta)")
    return float(theta)


def _hf_dtype(name: str | None) -> str:
    if name in (None, "float32", "auto"):
        return "float32"
    if name in DTYPES:
        return name
    raise ValueError(f"config.json torch_dtype={name!r} is not supported: one of {DTYPES}")


# ----- presets ------------------------------------------------------------------------------
# Hyper-parameters as published with the Qwen3 checkpoints (config.json of each model).


def tiny(**overrides: Any) -> ModelConfig:
    """~0.1 M parameters with the byte tokenizer's vocabulary: unit tests and the CPU demo."""
    base = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10_000.0,
        max_position_embeddings=4096,
    )
    base.update(overrides)
    return ModelConfig(**base)


def _qwen3(published: dict[str, Any], overrides: dict[str, Any]) -> ModelConfig:
    fields: dict[str, Any] = dict(
        vocab_size=151_936,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=40_960,
        param_dtype="bfloat16",
        dtype="bfloat16",
    )
    fields.update(published)
    fields.update(overrides)
    return ModelConfig(**fields)


def qwen3_0p6b(**overrides: Any) -> ModelConfig:
    published = dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        tie_word_embeddings=True,
    )
    return _qwen3(published, overrides)


def qwen3_1p7b(**overrides: Any) -> ModelConfig:
    published = dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        tie_word_embeddings=True,
    )
    return _qwen3(published, overrides)


def qwen3_4b(**overrides: Any) -> ModelConfig:
    published = dict(
        hidden_size=2560, intermediate_size=9728, num_layers=36, tie_word_embeddings=True
    )
    return _qwen3(published, overrides)


def qwen3_8b(**overrides: Any) -> ModelConfig:
    published = dict(
        hidden_size=4096, intermediate_size=12288, num_layers=36, tie_word_embeddings=False
    )
    return _qwen3(published, overrides)


PRESETS = {
    "tiny": tiny,
    "qwen3_0p6b": qwen3_0p6b,
    "qwen3_1p7b": qwen3_1p7b,
    "qwen3_4b": qwen3_4b,
    "qwen3_8b": qwen3_8b,
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A preset by name, with field overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: one of {sorted(PRESETS)}")
    return PRESETS[name](**overrides)


# ----- sharding rules -----------------------------------------------------------------------

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis name -> mesh axes it is split over (empty: replicated). Parameters, activations
# and the KV cache all name their axes logically; this one table decides the physical layout.
DEFAULT_RULES: dict[str, list[str]] = {
    # parameters
    "vocab": ["tensor"],
    "embed": ["fsdp"],
    "mlp": ["tensor"],
    "q_heads": ["tensor"],
    "kv_heads": ["tensor"],
    "head_dim": [],
    "norm": [],
    "layers": [],
    # activations
    "act_batch": ["data", "fsdp"],
    "act_length": [],
    "act_embed": [],
    "act_mlp": ["tensor"],
    "act_heads": ["tensor"],
    "act_kv_heads": ["tensor"],
    "act_vocab": ["tensor"],
    # KV cache [L, B, S, K, H]
    "cache_batch": ["data", "fsdp"],
    "cache_length": [],
}


@dataclass(frozen=True)
class ShardingConfig:
    """The rules table: logical axis names -> mesh axes (`data`, `fsdp`, `tensor`)."""

    rules: dict[str, list[str]] = dataclasses.field(
        default_factory=lambda: {k: list(v) for k, v in DEFAULT_RULES.items()}
    )
    """Overrides merge over the defaults; a logical axis absent from the table is replicated."""

    def __post_init__(self) -> None:
        merged = {k: list(v) for k, v in DEFAULT_RULES.items()}
        for name, axes in dict(self.rules).items():
            if isinstance(axes, str):
                axes = [axes]
            if axes is None:
                axes = []
            validate.require(
                isinstance(axes, list | tuple) and all(a in MESH_AXES for a in axes),
                self,
                f"rules[{name!r}]",
                f"a list of mesh axes drawn from {list(MESH_AXES)} (empty for replicated)",
                value=axes,
            )
            if len(set(axes)) != len(axes):
                raise ValueError(f"ShardingConfig.rules[{name!r}]={axes!r} repeats a mesh axis")
            merged[name] = list(axes)
        object.__setattr__(self, "rules", merged)


@dataclass(frozen=True)
class MeshConfig:
    """Shape of a (sub-)mesh; the product must equal the number of devices it is given."""

    data: int = 1
    """Pure data-parallel replicas."""
    fsdp: int = 1
    """Data parallel with parameters and optimizer state sharded (ZeRO-3 style)."""
    tensor: int = 1
    """Megatron-style tensor parallelism within heads / MLP."""

    def __post_init__(self) -> None:
        validate.positive_int(self, *MESH_AXES)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.fsdp, self.tensor)

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.tensor

    @property
    def data_parallel(self) -> int:
        """Devices a batch's rows are split over (data x fsdp): a trainer's batch must hold a
        multiple of it (`Trainer.row_multiple`, with gradient accumulation)."""
        return self.data * self.fsdp
