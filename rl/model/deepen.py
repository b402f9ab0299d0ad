"""A deeper model that computes exactly what a trained one does: block expansion.

`deepen(params, cfg, num_layers)` inserts new decoder blocks after the existing ones, spread
evenly (3 -> 6 gives old, new, old, new, old, new). Each new block is a copy of the block
before it with its two output projections (attention's `o`, the MLP's `down`) zeroed: a
pre-norm block adds `attn(norm(x)) @ o` and `mlp(norm(x)) @ down` to its input, so with both
zero it passes its input through unchanged, and the deeper model's logits are the trained
model's. Training then starts from the trained function with more capacity to grow into,
instead of from a random init that must relearn everything (LLaMA Pro's recipe).

`simloop deepen` (`launch.jobs.deepen`) does it to a serving-weights directory.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rl.model.config import ModelConfig

ZEROED = ("attn.o", "mlp.down")
"""The parameters of a new block that start at zero (its two writes to the residual stream)."""


def expansion(old: int, new: int) -> list[int | None]:
    """For each block of the deeper model, the block of the old one it is (an int), or None
    for a new block (a copy of the block before it). New blocks are spread evenly: the k-th
    old block is followed by its share of them."""
    if not 1 <= old <= new:
        raise ValueError(f"num_layers must be at least the model's {old}; got {new}")
    plan: list[int | None] = []
    for i in range(old):
        plan.append(i)
        plan += [None] * ((i + 1) * (new - old) // old - i * (new - old) // old)
    return plan


def deepen(params: dict, cfg: ModelConfig, num_layers: int) -> tuple[dict, ModelConfig]:
    """(the parameters of a `num_layers`-block model that computes what `params` does, its
    config). `params` is a pure dict (`nnx.to_pure_dict`) with the blocks stacked on the first
    axis of every leaf under `layers`; only those leaves change."""
    plan = expansion(cfg.num_layers, num_layers)
    source = []  # the old block each new block copies
    for j, i in enumerate(plan):
        source.append(i if i is not None else source[j - 1])
    zero = np.array([i is None for i in plan])

    def grow(path: tuple[str, ...], x: Any) -> Any:
        arr = np.asarray(x)
        if arr.shape[0] != cfg.num_layers:
            raise ValueError(
                f"layers.{'.'.join(path)} has {arr.shape[0]} blocks on its first axis; "
                f"the config says {cfg.num_layers}"
            )
        out = arr[np.array(source)]
        if ".".join(path) in ZEROED:
            out = np.where(zero.reshape((-1,) + (1,) * (arr.ndim - 1)), 0, out).astype(arr.dtype)
        return out

    def walk(tree: Any, path: tuple[str, ...]) -> Any:
        if isinstance(tree, dict):
            return {k: walk(v, (*path, str(k))) for k, v in tree.items()}
        return grow(path, tree)

    if "layers" not in params:
        raise ValueError("the parameters have no stacked `layers`: not a simloop decoder")
    out = {k: (walk(v, ()) if k == "layers" else v) for k, v in params.items()}
    return out, cfg.replace(num_layers=num_layers)
