"""One model loader for servers and trainers: where a role's model comes from, in the order a
role config names it (exported serving weights, else an HF checkpoint, else a random init of
its architecture), and the model or the trainer's starting point built from it.

    source = ModelSource.of_role(cfg.simulator)       # .weights, .hf_path, .model
    model = source.build(seed=cfg.run.seed, dtype="float32")     # a server: the whole Qwen3
    arch, host_params = source.trainer_start()        # a trainer: it places the params itself

A server builds the model in this process; a trainer builds only the architecture and the HF
parameters as host arrays, and restores serving weights itself (`Trainer.load_serving`), straight
into its sub-mesh's placement.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from rl.model.config import ModelConfig


@dataclass(frozen=True)
class ModelSource:
    """Exactly one of: `weights` (a serving-weights directory, `rl.model.params_io`),
    `hf_path` (an HF model directory) or `architecture` (a random init)."""

    weights: str | None = None
    hf_path: str | None = None
    architecture: ModelConfig | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("weights", "hf_path", "architecture") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(
                f"ModelSource needs exactly one of weights, hf_path, architecture; got {given}"
            )

    @classmethod
    def of_role(cls, role: Any) -> ModelSource:
        """The source a role config names (`RoleConfig`: `weights`, else `hf_path`, else its
        `model` architecture)."""
        if role.weights:
            return cls(weights=str(role.weights))
        if role.hf_path:
            return cls(hf_path=str(role.hf_path))
        return cls(architecture=role.model)

    @classmethod
    def of_dir(cls, path: str | os.PathLike) -> ModelSource:
        """An HF model directory."""
        return cls(hf_path=str(path))

    def build(self, *, seed: int, dtype: str | None = None):
        """The whole model (`Qwen3`) in this process, in `dtype` ("float32" / "bfloat16"; None:
        the checkpoint's or the architecture's). A random init draws from `seed`."""
        from flax import nnx

        from rl.model.hf_io import load_hf
        from rl.model.transformer import Qwen3, with_dtype

        if self.hf_path:
            _, model = load_hf(self.hf_path, dtype=dtype)  # read straight into `dtype`
            return model
        if self.weights:
            import jax
            import numpy as np

            from rl.model.params_io import load_params_like, read_model_config

            # Shapes only, then the stored values: a random init first cost every weight-loading
            # process 0.9 s of CPU with a warm compile cache, 3.5 s without (one small compile
            # per parameter shape). The values go where an eager init would have put them: the
            # default device, which `jax.default_device` may set.
            cfg = read_model_config(self.weights)
            graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(seed))))
            here = jax.device_put(np.zeros(())).sharding
            target = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here),
                nnx.to_pure_dict(state),
            )
            nnx.replace_by_pure_dict(state, load_params_like(self.weights, cfg, target))
            model = nnx.merge(graphdef, state)
        else:
            model = Qwen3(self.architecture, rngs=nnx.Rngs(seed))
        return model if dtype is None else with_dtype(model, dtype)

    def trainer_start(self) -> tuple[ModelConfig, dict | None]:
        """(architecture, host parameters as a pure dict or None) for a trainer: an HF
        checkpoint's parameters are read here; serving weights are not (the trainer restores
        them into its own placement: `weights`), nor is a random init (the trainer draws it)."""
        if self.weights:
            from rl.model.params_io import read_model_config

            return read_model_config(self.weights), None
        if self.hf_path:
            from flax import nnx

            from rl.model.hf_io import load_hf

            cfg, model = load_hf(self.hf_path)
            return cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return self.architecture, None


def model_from_params(cfg, params: dict):
    """A `Qwen3` of `cfg` holding `params` (a pure dict, `nnx.to_pure_dict` layout; host or
    device arrays), built from shapes only: no random init drawn and thrown away."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rl.model.transformer import Qwen3

    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return nnx.merge(graphdef, state)
