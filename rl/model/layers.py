"""Building blocks of the decoder: RMSNorm, RoPE, the SwiGLU MLP, and parameter helpers.

Every parameter is an `nnx.Param` with `logical_axes` metadata (see rl/model/sharding.py).
Norms and the RoPE rotation run in float32 whatever the compute dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from rl.model.config import ModelConfig
from rl.model.sharding import constrain


def dtype_of(name: str) -> jnp.dtype:
    return jnp.dtype(name)


def param(
    rngs: nnx.Rngs | None,
    shape: Sequence[int],
    axes: tuple[str, ...],
    cfg: ModelConfig,
    *,
    init: str = "normal",
) -> nnx.Param:
    """A parameter: normal(initializer_range), zeros or ones, stored in `cfg.param_dtype`."""
    dtype = dtype_of(cfg.param_dtype)
    if init == "normal":
        value = cfg.initializer_range * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)
        value = value.astype(dtype)
    elif init == "zeros":
        value = jnp.zeros(tuple(shape), dtype)
    elif init == "ones":
        value = jnp.ones(tuple(shape), dtype)
    else:
        raise ValueError(f"unknown init {init!r}")
    return nnx.Param(value, logical_axes=axes)


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, computed in float32, returned in the input dtype."""

    def __init__(self, dim: int, cfg: ModelConfig, *, axis_name: str = "norm"):
        self.eps = cfg.rms_norm_eps
        self.weight = param(None, (dim,), (axis_name,), cfg, init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        x_f32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x_f32), axis=-1, keepdims=True)
        normed = (x_f32 * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return self.weight.get_value().astype(x.dtype) * normed


def rope(x_BTNH: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, HF "rotate half" layout (the first and second halves of H pair up)."""
    head_dim = x_BTNH.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_freq
    angles_BTH = jnp.concatenate([angles_BTh, angles_BTh], axis=-1)
    cos = jnp.cos(angles_BTH)[:, :, None, :]
    sin = jnp.sin(angles_BTH)[:, :, None, :]
    x = x_BTNH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x * cos + rotated * sin).astype(x_BTNH.dtype)


def project(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`einsum(spec, x, w)` accumulated in float32 and returned in x's dtype: the same as a
    plain einsum in float32, and in bfloat16 a sum that does not depend on how a backend
    accumulates a bf16 dot (within one bf16 ulp of the exact product)."""
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(
        x.dtype
    )


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.compute_dtype = dtype_of(cfg.dtype)
        self.gate = param(rngs, (d, f), ("embed", "mlp"), cfg)
        self.up = param(rngs, (d, f), ("embed", "mlp"), cfg)
        self.down = param(rngs, (f, d), ("mlp", "embed"), cfg)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        dt = self.compute_dtype
        x_BTD = x_BTD.astype(dt)
        gate_BTF = project("BTD,DF->BTF", x_BTD, self.gate.get_value())
        up_BTF = project("BTD,DF->BTF", x_BTD, self.up.get_value())
        h_BTF = constrain(jax.nn.silu(gate_BTF) * up_BTF, ("act_batch", "act_length", "act_mlp"))
        return project("BTF,FD->BTD", h_BTF, self.down.get_value())
