"""The optimizer: optax AdamW with linear warmup + cosine decay and global-norm clipping."""

from __future__ import annotations

import jax
import optax

from rl.train.config import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """0 -> `lr` over `warmup_steps`, then cosine down to `lr * min_lr_ratio` over
    `decay_steps` (default: the rest of the run), flat after."""
    decay = cfg.decay_steps or max(total_steps - cfg.warmup_steps, 1)
    cosine = optax.cosine_decay_schedule(cfg.lr, decay, alpha=cfg.min_lr_ratio)
    if cfg.warmup_steps == 0:
        return cosine
    warmup = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
    return optax.join_schedules([warmup, cosine], [cfg.warmup_steps])


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    schedule = lr_schedule(cfg, total_steps)
    adamw = optax.adamw(
        schedule,
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=_norm_free,
    )
    if cfg.clip_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)


def _norm_free(params):
    """True for parameters that get weight decay: everything but RMSNorm weights."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any("norm" in str(getattr(k, "key", k)) for k in path), params
    )
