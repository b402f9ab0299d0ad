"""`OrbaxWeightLoader`: a vLLM worker extension that swaps in a simloop serving-weights version.

vLLM appends the class named by `--worker-extension-cls` to its worker's bases, and
`POST /collective_rpc {"method": "load_orbax_weights", "args": [path, version]}` (dev mode)
then calls the method on every worker of the server. The method reads the Orbax checkpoint
that `rl.model.params_io.save_params` wrote, renames and re-lays each tensor the way
`rl.model.hf_io.save_hf` would (HF Qwen3 names, [out, in] kernels, one tensor per layer), and
installs them:

- vllm-tpu (tpu-inference, flax_nnx models): the parameters live in the model runner's
  `state` pytree; each leaf is converted to the runner's layout, dtype and sharding and
  replaced in place (`install_into_runner_state`).
- vLLM's PyTorch runners: the pairs go to the model's own `load_weights`.

Everything vLLM-specific sits in `OrbaxWeightLoader._simloop_install`; the rest is plain
NumPy/JAX and is unit-tested without vLLM. This module never imports vLLM.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rl.model.config import ModelConfig
from rl.model.hf_io import tensor_table
from rl.model.integrity import check_finite, check_layout
from rl.model.params_io import PARAMS_DIR, read_model_config, read_verified
from rl.model.zarr_read import nested, read_arrays


def read_orbax_params(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any]]:
    """The config and parameter tree (host NumPy arrays, stored dtype) of a serving-weights
    directory. Nothing is placed on an accelerator: the checkpoint's own shardings name the
    trainer's devices, which this process does not have. The checkpoint must be sealed
    (`rl.model.integrity`, as trainers write it) and verify, as `simloop serve` requires."""
    import jax
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    cfg = read_model_config(path)  # FileNotFoundError names the missing file
    params_dir = path / PARAMS_DIR
    if not params_dir.is_dir():
        raise FileNotFoundError(f"{params_dir} not found: not a simloop params checkpoint")
    layout = check_layout(path)  # nothing is read from a checkpoint that is not confined

    def read() -> dict[str, Any]:
        checkpointer = ocp.PyTreeCheckpointer()
        metadata = checkpointer.metadata(params_dir)
        tree = getattr(metadata, "item_metadata", metadata)  # Orbax < 0.11: the tree itself
        tree = getattr(tree, "tree", tree)
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        return checkpointer.restore(params_dir, args=ocp.args.PyTreeRestore(restore_args=as_numpy))

    arrays = read_arrays(params_dir, layout)  # one hashed pass where the layout allows
    params = nested(params_dir, arrays) if arrays is not None else None
    if params is None:
        params = read_verified(path, read, layout)
    check_finite(params, f"weights {path}")  # a manifest does not vouch for the numbers
    return cfg, params


def iter_hf_weights(
    cfg: ModelConfig, params: Mapping[str, Any]
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, HF-layout array) for every tensor `save_hf` writes for `cfg`, in its order.
    `params` is the nested parameter dict of `save_params` (layers stacked on axis 0). The
    arrays are views of `params` where the layout allows (a transpose is not copied): the
    runner's layout transposes most of them back, so a load copies each tensor once, onto
    its device; a consumer that needs contiguous memory makes it (`_as_torch`)."""
    for t in tensor_table(cfg):
        node: Any = params
        for key in t.path:
            if not isinstance(node, Mapping) or key not in node:
                raise ValueError(
                    f"checkpoint lacks parameter {'.'.join(t.path)}, which a {cfg.architecture} "
                    "with its model_config.json has"
                )
            node = node[key]
        value = np.asarray(node)
        if t.per_layer:
            for i in range(cfg.num_layers):
                yield t.hf_name.format(i=i), t.to_hf(value[i], cfg)
        else:
            yield t.hf_name, t.to_hf(value, cfg)


# ----- tpu-inference: the runner's parameter pytree ---------------------------------------------

# tpu-inference's flax_nnx Qwen3 names its parameters like the HF tensors, with NNX leaf names
# where Flax modules are used; its loader reshapes q/k/v to [D, heads, H] and o to [N, H, D],
# transposes the MLP and LM head, zero-pads the head dim and repeats heads to fill the `model`
# mesh axis (tpu_inference/models/jax/utils/weight_utils.py). `_to_runner_layout` does the same.
_NNX_LEAF_NAMES = {"kernel": "weight", "embedding": "weight", "scale": "weight"}


def _hf_name_of(path: tuple[Any, ...]) -> str:
    *parents, leaf = (str(k) for k in path)
    return ".".join([*parents, _NNX_LEAF_NAMES.get(leaf, leaf)])


def _fit_heads(x: np.ndarray, heads_axis: int, dim_axis: int, shape: tuple[int, ...]) -> np.ndarray:
    """Zero-pad the head dim and repeat heads up to the runner's (padded) shape."""
    if x.shape[dim_axis] < shape[dim_axis]:
        widths = [(0, 0)] * x.ndim
        widths[dim_axis] = (0, shape[dim_axis] - x.shape[dim_axis])
        x = np.pad(x, widths)
    have, want = x.shape[heads_axis], shape[heads_axis]
    if have < want and want % have == 0:
        x = np.repeat(x, want // have, axis=heads_axis)
    return x


def _to_runner_layout(
    name: str, w: np.ndarray, cfg: ModelConfig, shape: tuple[int, ...]
) -> np.ndarray:
    parts = name.split(".")
    module, kind = parts[-2], parts[-1]
    heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads, "v_proj": cfg.num_kv_heads}
    if module in heads and kind == "weight":  # [heads*H, D] -> [D, heads, H]
        w = w.reshape(heads[module], cfg.head_dim, -1).transpose(2, 0, 1)
        w = _fit_heads(w, 1, 2, shape)
    elif module in heads and kind == "bias":  # [heads*H] -> [heads, H]
        w = _fit_heads(w.reshape(heads[module], cfg.head_dim), 0, 1, shape)
    elif module == "o_proj" and kind == "weight":  # [D, N*H] -> [N, H, D]
        w = w.reshape(w.shape[0], cfg.num_heads, cfg.head_dim).transpose(1, 2, 0)
        w = _fit_heads(w, 0, 1, shape)
    elif module in ("q_norm", "k_norm"):
        w = _fit_heads(w, 0, 0, shape)
    elif module in ("gate_proj", "up_proj", "down_proj", "lm_head"):
        w = w.T
    if tuple(w.shape) != tuple(shape):
        raise ValueError(
            f"tensor {name}: the checkpoint's shape {tuple(w.shape)} (in the runner's layout) "
            f"does not match the served model's {tuple(shape)}: a different architecture?"
        )
    return w


def install_into_runner_state(
    runner: Any, weights: Mapping[str, np.ndarray], cfg: ModelConfig
) -> int:
    """Replace every parameter of a tpu-inference runner (`runner.state`, an `nnx.State`) with
    its counterpart in `weights` (HF names and layout), keeping dtype and sharding. All tensors
    are converted and checked on the host first, so a mismatch leaves the served weights
    untouched. Returns the number of parameters replaced."""
    import jax
    from flax import nnx

    state = runner.state
    if not isinstance(state, nnx.State):
        raise NotImplementedError(
            f"runner.state is a {type(state).__name__}, not an nnx.State: tpu-inference runs "
            "this model through torchax (MODEL_IMPL_TYPE=vllm); only its flax_nnx models "
            "(Qwen3ForCausalLM's default) can be hot-loaded"
        )
    targets = []
    for path, var in nnx.to_flat_state(state):
        if isinstance(var, nnx.Param) or getattr(var, "type", None) is nnx.Param:
            targets.append((_hf_name_of(path), var))
    missing = sorted(name for name, _ in targets if name not in weights)
    unused = sorted(set(weights) - {name for name, _ in targets})
    if missing or unused:
        raise ValueError(
            f"checkpoint and served model disagree: the model has {len(missing)} parameter(s) "
            f"the checkpoint lacks (e.g. {missing[:3]}) and the checkpoint {len(unused)} the "
            f"model lacks (e.g. {unused[:3]})"
        )
    converted = []
    for name, var in targets:
        current = var.get_value() if hasattr(var, "get_value") else var.value
        w = _to_runner_layout(name, weights[name], cfg, tuple(current.shape))
        converted.append((var, np.asarray(w).astype(current.dtype, copy=False), current.sharding))
    # Drop the runner's second reference to the old leaves so each one is freed as soon as
    # its replacement is placed: HBM holds one extra tensor at a time, not a second model.
    if hasattr(runner, "state_leaves"):
        runner.state_leaves = ()
    for var, host, sharding in converted:
        placed = jax.device_put(host, sharding)
        if hasattr(var, "set_value"):
            var.set_value(placed)
        else:
            var.value = placed
    if hasattr(runner, "state_leaves"):  # the jitted step is dispatched with these leaves
        runner.state_leaves = tuple(jax.tree_util.tree_leaves(state))
    return len(converted)


def _as_torch(w: np.ndarray) -> Any:
    import torch

    if w.dtype.name == "bfloat16":  # NumPy (ml_dtypes) bf16 has no torch twin: share the bits
        return torch.from_numpy(np.ascontiguousarray(w).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(w))


# ----- the extension -----------------------------------------------------------------------------


class OrbaxWeightLoader:
    """Mixed into vLLM's worker class (`--worker-extension-cls`); its public methods become
    `collective_rpc` methods. vLLM refuses attribute names its worker already has, hence the
    `simloop` prefixes; it never calls `__init__` on an extension, so state is set lazily."""

    def load_orbax_weights(self, path: str, version: int | str) -> dict[str, Any]:
        """Serve the weights under `path` (a `save_params` directory) as `version`. Returns
        what the publisher checks: the version now served, the tensor count and timings.
        A version older than the one served is refused (the server keeps serving)."""
        version = int(version)  # /collective_rpc's JSON args may arrive as strings
        current = getattr(self, "_simloop_version", None)
        if current is not None and version < current:
            raise ValueError(f"version {version} is older than the served version {current}")
        started = time.perf_counter()
        cfg, params = read_orbax_params(path)
        weights = dict(iter_hf_weights(cfg, params))
        del params
        read_s = time.perf_counter() - started
        backend = self._simloop_install(weights, cfg)
        self._simloop_version, self._simloop_path = version, str(path)
        return {
            "version": version,
            "path": str(path),
            "tensors": len(weights),
            "backend": backend,
            "read_s": round(read_s, 3),
            "load_s": round(time.perf_counter() - started, 3),
        }

    def simloop_weight_version(self) -> dict[str, Any]:
        """The version and path last loaded through `load_orbax_weights` (None: the weights
        the server started with)."""
        return {
            "version": getattr(self, "_simloop_version", None),
            "path": getattr(self, "_simloop_path", None),
        }

    def _simloop_install(self, weights: dict[str, np.ndarray], cfg: ModelConfig) -> str:
        """The only step that touches vLLM internals: hand HF-named tensors to the model this
        worker serves. Returns which path it took. `self.model_runner` is the worker's runner
        on both vLLM's GPU worker and tpu-inference's TPUWorker."""
        runner = self.model_runner
        if getattr(runner, "state", None) is not None:  # tpu-inference: a JAX pytree
            install_into_runner_state(runner, weights, cfg)
            return "tpu-inference-state"
        # vLLM's PyTorch models: `load_weights(Iterable[(name, tensor)])` fuses q/k/v and
        # gate/up itself and skips `lm_head` for tied embeddings.
        runner.model.load_weights((name, _as_torch(w)) for name, w in weights.items())
        return "load_weights"
