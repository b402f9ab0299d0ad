"""Memory a config asks for, estimated before anything is allocated (no JAX): a server's
parameters plus KV cache, a trainer's parameters plus optimizer state and gradients, checked
against what the machine has, so an absurd size fails with the numbers instead of an
allocation error deep inside XLA.

    check_fits({"agent server KV cache": kv_cache_bytes(model, engine), ...}, available)
"""

from __future__ import annotations

import os

from rl.model.config import ModelConfig

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1 << 30


def param_bytes(m: ModelConfig) -> int:
    return m.num_params() * _BYTES.get(m.param_dtype, 4)


def kv_cache_bytes(m: ModelConfig, num_slots: int, max_seq_len: int) -> int:
    """K and V for every layer, slot and position (in the compute dtype)."""
    per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * _BYTES.get(m.dtype, 4)
    return num_slots * max_seq_len * per_token


def trainer_bytes(m: ModelConfig) -> int:
    """Parameters, gradients and AdamW's two moments (activations not counted)."""
    return param_bytes(m) * 2 + m.num_params() * 4 * 2


def host_memory_bytes() -> int:
    """Physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(needs: dict[str, int], available: int, where: str = "this machine") -> None:
    """ValueError saying how much `needs` adds up to (and of what) when it exceeds
    `available` bytes."""
    total = sum(needs.values())
    if total > available:
        parts = ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in needs.items())
        raise ValueError(
            f"the config needs about {total / GIB:.2f} GiB ({parts}) but {where} has "
            f"{available / GIB:.2f} GiB: lower the sizes (e.g. serve.engine.num_slots, "
            "serve.engine.max_seq_len, the model preset) or use a bigger machine"
        )


def device_memory_bytes(devices) -> int:
    """Memory of `devices` together: each accelerator's own limit, or the host's RAM for CPU
    devices (which all share it). Only this process's devices can be asked (a multi-process
    job's others are alike: theirs are counted as the average of its own)."""
    import jax

    local = [d for d in devices if d.process_index == jax.process_index()] or list(devices)
    try:
        stats = [d.memory_stats() or {} for d in local]
    except jax.errors.JaxRuntimeError:  # CPU devices of a multi-process job answer nothing
        stats = [{}]
    if all("bytes_limit" in s for s in stats):
        return sum(int(s["bytes_limit"]) for s in stats) * len(devices) // len(local)
    return host_memory_bytes()


def check_trainer_memory(model: ModelConfig, device_ids: list[int] | None, what: str) -> None:
    """Before a trainer is built: its parameters, gradients and optimizer state against the
    memory of the devices it gets (`device_ids`; None: all of this process's)."""
    import jax

    devices = jax.devices()
    devices = devices if device_ids is None else [devices[i] for i in device_ids]
    check_fits(
        {f"{what} (params, grads, AdamW)": trainer_bytes(model)},
        device_memory_bytes(devices),
        f"its {len(devices)} device(s)",
    )
