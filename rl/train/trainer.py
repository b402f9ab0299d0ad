"""One model's training state on one (sub-)mesh and its jitted train step.

    trainer = Trainer(model_cfg, optim_cfg, total_steps=100, loss="sft", mesh=mesh)
    metrics = trainer.step(batch)          # device arrays; pull them every N steps

The state is a plain pytree `{"step", "params", "opt_state", "rng"}` (params as the
`nnx.to_pure_dict` nested dict, the layout Orbax saves), placed by the logical-axis rules.
`train_step(state, batch) -> (state, metrics)` is pure and is jitted once, in `__init__`, with
explicit in/out shardings and the state donated.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rl.model.config import MeshConfig, ModelConfig
from rl.model.sharding import Rules, logical_to_spec, make_mesh, use_mesh
from rl.model.transformer import KVVisibility, Qwen3
from rl.train.config import OptimConfig
from rl.train.losses import get_loss, mask_vocab, token_logprobs
from rl.train.mesh import batch_sharding, data_parallel_size
from rl.train.optim import lr_schedule, make_optimizer

State = dict[str, Any]


def _nest(flat: Mapping[tuple, Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value
    return out


def param_shardings(abstract_params: nnx.State, mesh: Mesh, rules: Rules | None) -> dict:
    """`nnx.to_pure_dict` layout of the NamedSharding each parameter's logical axes ask for."""
    flat = {}
    for path, var in nnx.to_flat_state(abstract_params):
        value = var.get_value()
        axes = getattr(var, "logical_axes", None) or (None,) * len(value.shape)
        spec = logical_to_spec(axes, rules, shape=value.shape, mesh=mesh)
        flat[tuple(path)] = NamedSharding(mesh, spec)
    return _nest(flat)


class Trainer:
    """The model, optimizer and loss of one trainer, jitted on `mesh`."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        optim: OptimConfig,
        *,
        total_steps: int,
        loss: str,
        loss_cfg: Any = None,
        mesh: Mesh | None = None,
        rules: Rules | None = None,
        valid_vocab: int | None = None,
        seed: int = 0,
        init_params: Mapping | None = None,
        reference: bool = False,
    ):
        self.model_cfg, self.optim_cfg, self.loss_cfg = model_cfg, optim, loss_cfg
        self.mesh = mesh if mesh is not None else make_mesh(MeshConfig(), jax.devices()[:1])
        self.rules, self.valid_vocab, self.seed = rules, valid_vocab, seed
        self.loss_name, self.loss_fn = loss, get_loss(loss)
        self.total_steps = total_steps
        abstract = nnx.eval_shape(lambda: Qwen3(model_cfg, rngs=nnx.Rngs(0)))
        self.graphdef, abs_params, rest = nnx.split(abstract, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ValueError("Trainer: the model holds non-parameter state; not supported")
        self._rest = rest
        self._treedef = jax.tree.structure(abs_params)
        self.param_shardings = param_shardings(abs_params, self.mesh, rules)
        if jax.tree.structure(self.param_shardings) != jax.tree.structure(
            nnx.to_pure_dict(abs_params)
        ):
            raise AssertionError("parameter sharding tree does not match the parameter tree")
        self.optimizer = make_optimizer(optim, total_steps)
        self.schedule = lr_schedule(optim, total_steps)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        abs_pure = jax.tree.map(
            lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(abs_params)
        )
        opt_abstract = jax.eval_shape(self.optimizer.init, abs_pure)
        opt_sh = optax.tree_map_params(
            self.optimizer,
            lambda _, s: s,
            opt_abstract,
            self.param_shardings,
            transform_non_params=lambda _: replicated,
        )
        self.state_shardings: State = {
            "step": replicated,
            "params": self.param_shardings,
            "opt_state": opt_sh,
            "rng": replicated,
        }
        self.batch_sharding = batch_sharding(self.mesh)
        self._step_fn = jax.jit(
            self._train_step,
            in_shardings=(
                self.state_shardings,
                self.batch_sharding,
                self.param_shardings if reference else None,
            ),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=(0,),
        )
        self._logp_fn = jax.jit(
            self._logprobs,
            in_shardings=(self.param_shardings, self.batch_sharding),
            out_shardings=self.batch_sharding,
        )
        self._exact_fn = jax.jit(
            self._greedy_exact,
            in_shardings=(self.param_shardings, self.batch_sharding),
            out_shardings=replicated,
        )
        params = self._init_params() if init_params is None else self.place_params(init_params)
        self.state = self._init_state(params)
        self.reference = self.copy_params(params) if reference else None

    # ----- state ----------------------------------------------------------------------------

    def _init_params(self) -> dict:
        cfg, seed = self.model_cfg, self.seed

        def init():
            return nnx.to_pure_dict(nnx.state(Qwen3(cfg, rngs=nnx.Rngs(seed)), nnx.Param))

        with use_mesh(self.mesh, self.rules):
            return jax.jit(init, out_shardings=self.param_shardings)()

    def place_params(self, params: Mapping) -> dict:
        """Put a host or device parameter dict onto this trainer's shardings and dtype."""
        dtype = jnp.dtype(self.model_cfg.param_dtype)
        return jax.tree.map(
            lambda x, s: jax.device_put(jnp.asarray(x, dtype), s),
            dict(params),
            self.param_shardings,
        )

    def reset_params(self, params: Mapping) -> None:
        """Start over from `params` (host or device): fresh optimizer state at step 0, and the
        frozen reference (when there is one) set to the same weights."""
        placed = self.place_params(params)
        self.state = self._init_state(placed)
        if self.reference is not None:
            self.reference = self.copy_params(placed)

    def set_reference(self, params: Mapping) -> None:
        """The frozen KL reference (a trainer built with `reference=True`), e.g. the run's
        stored one when RL resumes."""
        if self.reference is None:
            raise ValueError("this trainer was built without a reference (reference=False)")
        self.reference = self.copy_params(self.place_params(params))

    def copy_params(self, params: Mapping) -> dict:
        return jax.tree.map(lambda x: x.copy(), dict(params))

    def _init_state(self, params: dict) -> State:
        opt_init = jax.jit(self.optimizer.init, out_shardings=self.state_shardings["opt_state"])
        rng = jax.random.key_data(jax.random.key(self.seed))
        replicated = self.state_shardings["step"]
        return {
            "step": jax.device_put(jnp.zeros((), jnp.int32), replicated),
            "params": params,
            "opt_state": opt_init(params),
            "rng": jax.device_put(rng, replicated),
        }

    def abstract_state(self) -> State:
        """ShapeDtypeStructs with shardings: the restore target for checkpoints."""
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            self.state,
            self.state_shardings,
        )

    @property
    def params(self) -> dict:
        return self.state["params"]

    @property
    def step_count(self) -> int:
        from rl.train.multihost import fetch

        return int(fetch(self.state["step"]))

    def model(self, params: Mapping | None = None) -> Qwen3:
        """An NNX model over `params` (default: the current ones), e.g. to export or decode."""
        params = self.params if params is None else params
        return nnx.merge(self.graphdef, self._as_state(params), self._rest)

    def _as_state(self, params: Mapping) -> nnx.State:
        return jax.tree.unflatten(self._treedef, jax.tree.leaves(params))

    # ----- the step ---------------------------------------------------------------------------

    def _logits(self, params, batch) -> jax.Array:
        model = nnx.merge(self.graphdef, self._as_state(params), self._rest)
        visibility = None
        if "kv_epoch" in batch:  # compacted KV sessions: what each token saw when sampled
            visibility = KVVisibility(batch["kv_epoch"], batch["kv_start"], batch["kv_kept"])
        logits_BTV = model(batch["tokens"], batch["positions"], batch["segment_ids"], visibility)
        return mask_vocab(logits_BTV, self.valid_vocab)

    def _logprobs(self, params, batch) -> jax.Array:
        return token_logprobs(self._logits(params, batch), batch["targets"])[0]

    def _greedy_exact(self, params, batch) -> jax.Array:
        logits_BTV = self._logits(params, batch)
        hit_BT = (jnp.argmax(logits_BTV, axis=-1) == batch["targets"]) | (batch["loss_mask"] == 0)
        return jnp.all(hit_BT, axis=-1)

    def _loss(self, params, batch):
        return self.loss_fn(self._logits(params, batch), batch, self.loss_cfg)

    def _train_step(self, state: State, batch: dict, reference: dict | None):
        accum = self.optim_cfg.grad_accum
        params = state["params"]
        if reference is not None:
            batch = {
                **batch,
                "ref_logprobs": jax.lax.stop_gradient(self._logprobs(reference, batch)),
            }
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)
        if accum == 1:
            (_, metrics), grads = grad_fn(params, batch)
            metrics = {k: v for k, v in metrics.items() if k != "weight"}
        else:
            grads, metrics = self._accumulate(grad_fn, params, batch, accum)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], params)
        new_state = {
            "step": state["step"] + 1,
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
            "rng": state["rng"],
        }
        metrics = {
            **metrics,
            "grad_norm": optax.global_norm(grads),
            "lr": self.schedule(state["step"]),
        }
        return new_state, metrics

    @staticmethod
    def _accumulate(grad_fn, params, batch, accum: int):
        """Gradients of the whole batch from `accum` micro-batches, exactly: each micro-batch's
        normalised loss is re-weighted by its share of the loss's normaliser (`weight`:
        tokens, episodes or a constant), so padding rows never dilute the gradient. Metrics
        are weighted the same way; `*_max` / `*_min` reduce by max / min, `tokens` sums."""
        micro = jax.tree.map(lambda x: x.reshape(accum, -1, *x.shape[1:]), batch)

        def body(carry, mb):
            (_, m), g = grad_fn(params, mb)
            w = m["weight"]
            g_sum, m_acc = carry
            g_sum = jax.tree.map(lambda a, b: a + w * b, g_sum, g)
            out = {}
            for k, v in m_acc.items():
                if k.endswith("_max"):
                    out[k] = jnp.maximum(v, m[k])
                elif k.endswith("_min"):
                    out[k] = jnp.minimum(v, m[k])
                elif k in ("tokens", "weight"):
                    out[k] = v + m[k]
                else:
                    out[k] = v + w * m[k]
            return (g_sum, out), None

        first = jax.tree.map(lambda x: x[0], micro)
        (_, m_shape), g_shape = jax.eval_shape(grad_fn, params, first)
        init_m = {}
        for k, v in m_shape.items():
            fill = -jnp.inf if k.endswith("_max") else jnp.inf if k.endswith("_min") else 0.0
            init_m[k] = jnp.full(v.shape, fill, v.dtype)
        g0 = jax.tree.map(jnp.zeros_like, g_shape)
        (g_sum, m_acc), _ = jax.lax.scan(body, (g0, init_m), micro)
        total = jnp.maximum(m_acc.pop("weight"), 1e-9)
        grads = jax.tree.map(lambda g: g / total, g_sum)
        metrics = {
            k: v if k == "tokens" or k.endswith(("_max", "_min")) else v / total
            for k, v in m_acc.items()
        }
        return grads, metrics

    @property
    def row_multiple(self) -> int:
        """What a batch's row count must be a multiple of: the data-parallel devices times
        the micro-batches of gradient accumulation."""
        return data_parallel_size(self.mesh) * self.optim_cfg.grad_accum

    def device_batch(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        rows = next(iter(batch.values())).shape[0]
        dp = self.row_multiple
        if rows % dp:
            raise ValueError(
                f"batch of {rows} rows does not split over {data_parallel_size(self.mesh)} "
                f"data-parallel devices x grad_accum {self.optim_cfg.grad_accum}: use a "
                f"multiple of {dp}"
            )
        if jax.process_count() == 1:
            return {k: jax.device_put(np.asarray(v), self.batch_sharding) for k, v in batch.items()}
        # Several processes (multi-host): each holds the same global batch and places only
        # the rows of its own devices; no process sends another's rows anywhere.
        return {k: self._global_array(np.asarray(v)) for k, v in batch.items()}

    def _global_array(self, host: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(host.shape, self.batch_sharding, lambda i: host[i])

    def step(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """One optimizer step; returns the metrics as device arrays (no host sync)."""
        with use_mesh(self.mesh, self.rules):
            self.state, metrics = self._step_fn(
                self.state, self.device_batch(batch), self.reference
            )
        return metrics

    def logprobs(self, batch: Mapping[str, np.ndarray], params: Mapping | None = None):
        """log p(targets) under `params` (default: current), [B, T] on the device."""
        with use_mesh(self.mesh, self.rules):
            return self._logp_fn(
                self.params if params is None else params, self.device_batch(batch)
            )

    def greedy_exact(self, batch: Mapping[str, np.ndarray], params: Mapping | None = None):
        """[B] bool, one unpacked example per row: every masked target token is the argmax of
        its logits. That is exactly "greedy decoding from the row's context writes its target"
        (each step's input is then the target token), computed in one teacher-forced forward
        instead of a decode loop (argmax takes the first of equal logits, as greedy sampling
        does)."""
        with use_mesh(self.mesh, self.rules):
            return self._exact_fn(
                self.params if params is None else params, self.device_batch(batch)
            )

    # ----- export -----------------------------------------------------------------------------

    def export_serving(
        self,
        path: str | Path,
        dtype: str | None = None,
        extra_files: Mapping[str, str] | None = None,
    ) -> Path:
        """Serving weights (`rl.model.params_io` format: Orbax params + model_config.json,
        and `extra_files`) and their manifest (`rl.model.integrity`), which servers verify
        before loading."""
        from rl.model.params_io import save_params

        return save_params(self.model(), path, dtype=dtype, extra_files=extra_files)

    def export_hf(self, path: str | Path, dtype: str | None = None) -> Path:
        """HF safetensors + config.json (what vLLM loads), with a manifest."""
        from rl.model.hf_io import save_hf
        from rl.model.integrity import write_manifest

        save_hf(self.model_cfg, self.model(), path, dtype=dtype)
        write_manifest(path)
        return Path(path)

    def load_serving(self, path: str | Path, *, require_manifest: bool = False) -> dict:
        """Parameters from serving weights on disk, placed on this trainer's mesh: verified
        against their manifest (required when `require_manifest`, else when there is one) and
        refused (CheckpointError) when they hold NaN or inf."""
        from rl.model.params_io import load_params

        return load_params(path, self.model(), require_manifest=require_manifest)
