"""Training losses, a registry by name: `sft` (masked cross-entropy) and `policy` (clipped,
importance-corrected policy gradient with group-relative advantages computed on the host).

A loss is `fn(logits_BTV, batch, cfg) -> (loss, metrics)`: float32 logits of the inputs, the
batch dict (`targets`, `loss_mask`, and for `policy` `behavior_logprobs` and `advantages`,
all [B, T] and aligned with `targets`), and the loss's config (None for `sft`). Metrics are
scalar arrays that stay on the device; `weight` is the loss's normaliser (tokens, episodes, or
a constant), which gradient accumulation uses to combine micro-batches exactly. Everything is
computed in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from rl.train.config import PolicyLossConfig

Batch = dict[str, jax.Array]
LossFn = Callable[[jax.Array, Batch, object], tuple[jax.Array, dict[str, jax.Array]]]

_NEG = -1e9  # masked logits: exp underflows to exactly 0, and 0 * _NEG stays finite

LOSSES: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    def add(fn: LossFn) -> LossFn:
        LOSSES[name] = fn
        return fn

    return add


def get_loss(name: str) -> LossFn:
    if name not in LOSSES:
        raise ValueError(f"loss {name!r} is unknown: one of {sorted(LOSSES)}")
    return LOSSES[name]


def mask_vocab(logits_BTV: jax.Array, valid_vocab: int | None) -> jax.Array:
    """Logits of ids >= `valid_vocab` (embedding rows no tokenizer id maps to) pushed to -1e9,
    exactly as the inference engine's sampler excludes them, so trainer and sampler logprobs
    are normalised over the same vocabulary."""
    if valid_vocab is None or valid_vocab >= logits_BTV.shape[-1]:
        return logits_BTV
    keep_V = jnp.arange(logits_BTV.shape[-1]) < valid_vocab
    return jnp.where(keep_V, logits_BTV, _NEG)


def token_logprobs(logits_BTV: jax.Array, targets_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(log p(target), entropy of the whole distribution), both [B, T] float32."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    logp_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    p_BTV = jnp.exp(logp_BTV)
    entropy_BT = -jnp.sum(jnp.where(p_BTV > 0, p_BTV * logp_BTV, 0.0), axis=-1)
    return logp_BT, entropy_BT


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


@register_loss("sft")
def sft_loss(logits_BTV: jax.Array, batch: Batch, cfg: object = None):
    """Mean cross-entropy over the tokens whose `loss_mask` is not 0, each weighted by its
    `loss_mask` (1 but where `DatasetConfig.observation_weight` says more)."""
    logp_BT, entropy_BT = token_logprobs(logits_BTV, batch["targets"])
    mask_BT = batch["loss_mask"].astype(jnp.float32)
    loss = -_masked_mean(logp_BT, mask_BT)
    metrics = {
        "loss": loss,
        "entropy": _masked_mean(entropy_BT, mask_BT),
        "tokens": jnp.sum(mask_BT > 0).astype(jnp.float32),
        "weight": jnp.sum(mask_BT),
    }
    return loss, metrics


@register_loss("policy")
def policy_loss(logits_BTV: jax.Array, batch: Batch, cfg: PolicyLossConfig | None = None):
    """Clipped policy gradient with truncated importance sampling.

    Three log-probabilities per generated token: `logp` (the parameters being updated),
    `prox` (the same parameters before this update: `batch["proximal_logprobs"]` when a batch
    is reused for several updates, else `logp` with its gradient stopped) and `behavior` (the
    inference server's, possibly S versions stale and computed by other kernels).

    - PPO term: `min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)` with `r = exp(logp - prox)`.
    - Truncated IS weight `w = min(exp(prox - behavior), C)`, no gradient: corrects for
      sampling from the server's distribution instead of the trainer's.
    - Optional `kl_coef * KL(pi || ref)` (k3 estimator) to the frozen reference.
    """
    cfg = cfg or PolicyLossConfig()
    logp_BT, entropy_BT = token_logprobs(logits_BTV, batch["targets"])
    mask_BT = batch["loss_mask"].astype(jnp.float32)
    adv_BT = batch["advantages"].astype(jnp.float32)
    behavior_BT = batch["behavior_logprobs"].astype(jnp.float32)
    prox_BT = batch.get("proximal_logprobs")
    prox_BT = jax.lax.stop_gradient(logp_BT if prox_BT is None else prox_BT.astype(jnp.float32))

    ratio_BT = jnp.exp(logp_BT - prox_BT)
    unclipped_BT = ratio_BT * adv_BT
    clipped_BT = jnp.clip(ratio_BT, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv_BT
    objective_BT = jnp.minimum(unclipped_BT, clipped_BT)

    log_is_BT = jnp.where(mask_BT > 0, prox_BT - behavior_BT, 0.0)
    is_ratio_BT = jnp.exp(log_is_BT)
    if cfg.tis_cap is None:
        weight_BT = jnp.ones_like(is_ratio_BT)
    else:
        weight_BT = jnp.minimum(is_ratio_BT, cfg.tis_cap)
    per_token_BT = -weight_BT * objective_BT

    metrics: dict[str, jax.Array] = {}
    if cfg.kl_coef > 0:
        ref_BT = batch["ref_logprobs"].astype(jnp.float32)
        delta_BT = ref_BT - logp_BT
        kl_BT = jnp.exp(delta_BT) - delta_BT - 1.0
        per_token_BT = per_token_BT + cfg.kl_coef * kl_BT
        metrics["kl_ref"] = _masked_mean(kl_BT, mask_BT)

    rollout_tokens_BT = batch.get("rollout_tokens")
    loss = aggregate(per_token_BT, mask_BT, cfg, rollout_tokens_BT)
    valid = mask_BT > 0
    big = jnp.finfo(jnp.float32).max
    metrics.update(
        loss=loss,
        pg_loss=aggregate(-weight_BT * objective_BT, mask_BT, cfg, rollout_tokens_BT),
        entropy=_masked_mean(entropy_BT, mask_BT),
        # KL(sampler || trainer) estimated on the sampler's own tokens (k1 and k3).
        mismatch_kl=_masked_mean(-log_is_BT, mask_BT),
        mismatch_kl_k3=_masked_mean(jnp.exp(log_is_BT) - log_is_BT - 1.0, mask_BT),
        clip_frac=_masked_mean((clipped_BT < unclipped_BT).astype(jnp.float32), mask_BT),
        is_ratio_mean=_masked_mean(is_ratio_BT, mask_BT),
        is_ratio_max=jnp.max(jnp.where(valid, is_ratio_BT, -big)),
        is_ratio_min=jnp.min(jnp.where(valid, is_ratio_BT, big)),
        tis_capped_frac=_masked_mean(
            (is_ratio_BT > (cfg.tis_cap or big)).astype(jnp.float32), mask_BT
        ),
        advantage_mean=_masked_mean(adv_BT, mask_BT),
        tokens=jnp.sum(mask_BT),
        weight=normaliser(mask_BT, cfg, rollout_tokens_BT),
    )
    return loss, metrics


def _rollout_weights(rollout_tokens_BT: jax.Array | None) -> jax.Array:
    """Per token, 1 / (generated tokens of its row's rollout in the whole step's batch)."""
    if rollout_tokens_BT is None:
        raise ValueError(
            "aggregation 'rollout_mean' needs batch['rollout_tokens'] "
            "(rl.train.rollouts.build_rl_batch adds it)"
        )
    return 1.0 / jnp.maximum(rollout_tokens_BT.astype(jnp.float32), 1.0)


def normaliser(
    mask_BT: jax.Array, cfg: PolicyLossConfig, rollout_tokens_BT: jax.Array | None = None
) -> jax.Array:
    """What `aggregate` divides by (tokens, episodes, rollouts, or rows x T): the weight of a
    micro-batch when gradients are accumulated. For `rollout_mean` it is the micro-batch's
    share of rollouts (a rollout whose segments straddle micro-batches counts fractionally),
    so the accumulated loss is the mean over the step's rollouts."""
    if cfg.advantage == "drgrpo":
        return jnp.asarray(mask_BT.shape[0] * mask_BT.shape[1], jnp.float32)
    if cfg.aggregation == "seq_mean":
        return jnp.sum((mask_BT.sum(1) > 0).astype(jnp.float32))
    if cfg.aggregation == "rollout_mean":
        return jnp.sum(mask_BT * _rollout_weights(rollout_tokens_BT))
    return jnp.sum(mask_BT)


def aggregate(
    per_token_BT: jax.Array,
    mask_BT: jax.Array,
    cfg: PolicyLossConfig,
    rollout_tokens_BT: jax.Array | None = None,
) -> jax.Array:
    """Reduce per-token losses to a scalar as configured (see `PolicyLossConfig`).
    `rollout_tokens_BT` (`rollout_mean` only): per token, the generated tokens of its row's
    rollout in the step's batch."""
    if cfg.advantage == "drgrpo":
        return jnp.sum(per_token_BT * mask_BT) / (mask_BT.shape[0] * mask_BT.shape[1])
    if cfg.aggregation == "rollout_mean":
        total = jnp.sum(per_token_BT * mask_BT * _rollout_weights(rollout_tokens_BT))
        return total / jnp.maximum(normaliser(mask_BT, cfg, rollout_tokens_BT), 1e-9)
    if cfg.aggregation == "seq_mean":
        per_row_B = jnp.sum(per_token_BT * mask_BT, axis=1) / jnp.maximum(mask_BT.sum(1), 1.0)
        rows_B = (mask_BT.sum(1) > 0).astype(jnp.float32)
        return jnp.sum(per_row_B * rows_B) / jnp.maximum(rows_B.sum(), 1.0)
    return _masked_mean(per_token_BT, mask_BT)
