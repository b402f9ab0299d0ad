"""rl/train/losses.py against hand-computed values and a plain-Python-loop reference."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.data.trajectory import Trajectory, Turn
from rl.train.config import PolicyLossConfig
from rl.train.losses import (
    aggregate,
    get_loss,
    mask_vocab,
    normaliser,
    policy_loss,
    sft_loss,
    token_logprobs,
)
from rl.train.rollouts import build_rl_batch, rollout_advantages

LOG3 = math.log(3.0)


# ----- the reference: one token at a time, numpy float64 ----------------------------------------


def _log_softmax(row):
    row = np.asarray(row, np.float64)
    m = row.max()
    return row - m - math.log(sum(math.exp(x - m) for x in row))


def ref_policy_loss(logits, batch, cfg):
    """Per-token loops over b, t of the loss as PolicyLossConfig documents it."""
    logits = np.asarray(logits, np.float64)
    B, T, _ = logits.shape
    mask = np.asarray(batch["loss_mask"], np.float64)
    prox_in = batch.get("proximal_logprobs")
    per_token = np.zeros((B, T))
    pg_token = np.zeros((B, T))
    logp = np.zeros((B, T))
    ent = np.zeros((B, T))
    log_is = np.zeros((B, T))
    kl = np.zeros((B, T))
    binding = np.zeros((B, T))
    capped = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            lsm = _log_softmax(logits[b, t])
            lp = lsm[int(batch["targets"][b, t])]
            logp[b, t] = lp
            ent[b, t] = -sum(math.exp(x) * x for x in lsm)
            prox = lp if prox_in is None else float(prox_in[b, t])
            adv = float(batch["advantages"][b, t])
            r = math.exp(lp - prox)
            unclipped = r * adv
            clipped = min(max(r, 1.0 - cfg.eps_low), 1.0 + cfg.eps_high) * adv
            obj = min(unclipped, clipped)
            binding[b, t] = clipped < unclipped
            li = prox - float(batch["behavior_logprobs"][b, t]) if mask[b, t] else 0.0
            log_is[b, t] = li
            is_ratio = math.exp(li)
            if cfg.tis_cap is None:
                w = 1.0
            else:
                w = min(is_ratio, cfg.tis_cap)
                capped[b, t] = is_ratio > cfg.tis_cap
            pg_token[b, t] = -w * obj
            per_token[b, t] = -w * obj
            if cfg.kl_coef > 0:
                d = float(batch["ref_logprobs"][b, t]) - lp
                kl[b, t] = math.exp(d) - d - 1.0
                per_token[b, t] += cfg.kl_coef * kl[b, t]

    def reduce(x):
        if cfg.advantage == "drgrpo":
            total = 0.0
            for b in range(B):
                for t in range(T):
                    total += x[b, t] * mask[b, t]
            return total / (B * T)
        if cfg.aggregation == "seq_mean":
            rows = []
            for b in range(B):
                n = sum(mask[b])
                if n > 0:
                    rows.append(sum(x[b, t] * mask[b, t] for t in range(T)) / n)
            return sum(rows) / max(len(rows), 1)
        return masked_mean(x)

    def masked_mean(x):
        n = mask.sum()
        return sum(x[b, t] * mask[b, t] for b in range(B) for t in range(T)) / max(n, 1.0)

    valid = [(b, t) for b in range(B) for t in range(T) if mask[b, t]]
    metrics = {
        "loss": reduce(per_token),
        "pg_loss": reduce(pg_token),
        "entropy": masked_mean(ent),
        "mismatch_kl": masked_mean(-log_is),
        "mismatch_kl_k3": masked_mean(np.exp(log_is) - log_is - 1.0),
        "clip_frac": masked_mean(binding),
        "is_ratio_mean": masked_mean(np.exp(log_is)),
        "is_ratio_max": max(math.exp(log_is[bt]) for bt in valid),
        "is_ratio_min": min(math.exp(log_is[bt]) for bt in valid),
        "tis_capped_frac": masked_mean(capped),
        "advantage_mean": masked_mean(np.asarray(batch["advantages"], np.float64)),
        "tokens": mask.sum(),
        # the normaliser `reduce` divides by: what gradient accumulation weighs micro-batches by
        "weight": (
            B * T
            if cfg.advantage == "drgrpo"
            else sum(1 for b in range(B) if mask[b].sum() > 0)
            if cfg.aggregation == "seq_mean"
            else mask.sum()
        ),
    }
    if cfg.kl_coef > 0:
        metrics["kl_ref"] = masked_mean(kl)
    return metrics["loss"], metrics


def _random_policy_batch(seed, B=2, T=3, V=5, *, prox=False, ref=False):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 1.5, (B, T, V)).astype(np.float32)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    mask = np.array([[1, 1, 0], [0, 1, 1]], np.int32)[:B, :T]
    lsm = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    logp = np.take_along_axis(lsm, targets[..., None], -1)[..., 0]
    batch = {
        "targets": targets,
        "loss_mask": mask,
        # Sampler logprobs off by up to +-1.2 nats, so some IS ratios exceed the cap of 2.
        "behavior_logprobs": (logp + rng.uniform(-1.2, 1.2, (B, T))).astype(np.float32),
        "advantages": np.repeat(rng.normal(0, 1, (B, 1)), T, 1).astype(np.float32),
    }
    if prox:
        # Ratios exp(logp - prox) spread over [0.5, 1.65]: inside and outside the clip range.
        batch["proximal_logprobs"] = (logp - rng.uniform(-0.7, 0.5, (B, T))).astype(np.float32)
    if ref:
        batch["ref_logprobs"] = (logp + rng.uniform(-0.5, 0.5, (B, T))).astype(np.float32)
    return logits, batch


def _jnp(batch):
    return {k: jnp.asarray(v) for k, v in batch.items()}


# ----- registry, mask_vocab, token_logprobs ------------------------------------------------------


def test_registry_returns_the_loss_functions_and_rejects_unknown_names():
    assert get_loss("sft") is sft_loss
    assert get_loss("policy") is policy_loss
    with pytest.raises(ValueError, match=r"'dpo'.*policy.*sft"):
        get_loss("dpo")


def test_mask_vocab_renormalises_over_valid_ids_only():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (2, 3, 6)).astype(np.float32)
    logits[..., 4:] += 10.0  # the invalid ids would dominate if they were not masked
    masked = mask_vocab(jnp.asarray(logits), 4)
    logp = np.asarray(jax.nn.log_softmax(masked, axis=-1))
    expected = np.asarray(jax.nn.log_softmax(jnp.asarray(logits[..., :4]), axis=-1))
    np.testing.assert_allclose(logp[..., :4], expected, rtol=0, atol=1e-6)
    probs = np.exp(logp)
    assert np.all(probs[..., 4:] < 1e-30)
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-6)
    # token_logprobs over the masked logits: same target logprobs, entropy over 4 ids.
    targets = rng.integers(0, 4, (2, 3)).astype(np.int32)
    lp, ent = token_logprobs(masked, jnp.asarray(targets))
    np.testing.assert_allclose(
        np.asarray(lp), np.take_along_axis(expected, targets[..., None], -1)[..., 0], atol=1e-6
    )
    p4 = np.exp(expected)
    np.testing.assert_allclose(np.asarray(ent), -(p4 * expected).sum(-1), atol=1e-5)
    assert np.all(np.isfinite(np.asarray(ent)))


def test_mask_vocab_is_the_identity_without_extra_rows():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(1, 2, 5)), jnp.float32)
    assert mask_vocab(logits, None) is logits
    assert mask_vocab(logits, 5) is logits
    assert mask_vocab(logits, 9) is logits
    assert not np.array_equal(np.asarray(mask_vocab(logits, 4)), np.asarray(logits))


def test_token_logprobs_hand_values():
    # V=3: uniform row -> log(1/3), entropy log 3; a row (0, log 2, 0) -> p = (1/4, 1/2, 1/4).
    logits = jnp.asarray([[[0.0, 0.0, 0.0], [0.0, math.log(2.0), 0.0]]], jnp.float32)
    lp, ent = token_logprobs(logits, jnp.asarray([[2, 1]], jnp.int32))
    np.testing.assert_allclose(np.asarray(lp), [[-LOG3, math.log(0.5)]], atol=1e-6)
    h2 = -(0.25 * math.log(0.25) * 2 + 0.5 * math.log(0.5))
    np.testing.assert_allclose(np.asarray(ent), [[LOG3, h2]], atol=1e-6)
    assert lp.dtype == jnp.float32 and ent.dtype == jnp.float32


# ----- sft -------------------------------------------------------------------------------------


def test_sft_loss_is_the_masked_mean_cross_entropy():
    # Row 0 uniform (CE log 3); row 1 p = (1/4, 1/2, 1/4), target 1 (CE log 2) and target 0
    # (CE log 4, masked out).
    logits = jnp.asarray(
        [
            [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
            [[0.0, math.log(2.0), 0.0], [0.0, math.log(2.0), 0.0]],
        ],
        jnp.float32,
    )
    batch = {
        "targets": jnp.asarray([[0, 2], [1, 0]], jnp.int32),
        "loss_mask": jnp.asarray([[1, 1], [1, 0]], jnp.int32),
    }
    loss, m = sft_loss(logits, batch)
    expected = (LOG3 + LOG3 + math.log(2.0)) / 3
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)
    np.testing.assert_allclose(float(m["loss"]), expected, rtol=1e-6)
    assert float(m["tokens"]) == 3.0
    h2 = -(0.25 * math.log(0.25) * 2 + 0.5 * math.log(0.5))
    np.testing.assert_allclose(float(m["entropy"]), (2 * LOG3 + h2) / 3, rtol=1e-6)
    # An all-zero mask gives 0 (not NaN).
    loss0, _ = sft_loss(logits, {**batch, "loss_mask": jnp.zeros((2, 2), jnp.int32)})
    assert float(loss0) == 0.0


def test_sft_loss_matches_optax_cross_entropy_on_random_logits():
    import optax

    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, (2, 4, 7)).astype(np.float32)
    targets = rng.integers(0, 7, (2, 4)).astype(np.int32)
    mask = np.array([[1, 0, 1, 1], [0, 0, 1, 0]], np.int32)
    loss, _ = sft_loss(jnp.asarray(logits), {"targets": targets, "loss_mask": mask})
    ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, targets))
    np.testing.assert_allclose(float(loss), (ce * mask).sum() / mask.sum(), rtol=1e-6)


# ----- policy: hand-computed values ------------------------------------------------------------


def _uniform_batch(behavior, adv, mask=None, **extra):
    """V=3 uniform logits (logp = -log 3 for every target), B=1, T=len(behavior)."""
    T = len(behavior)
    logits = jnp.zeros((1, T, 3), jnp.float32)
    batch = {
        "targets": jnp.asarray([[t % 3 for t in range(T)]], jnp.int32),
        "loss_mask": jnp.asarray([mask or [1] * T], jnp.int32),
        "behavior_logprobs": jnp.asarray([behavior], jnp.float32),
        "advantages": jnp.asarray([adv], jnp.float32),
    }
    batch.update({k: jnp.asarray([v], jnp.float32) for k, v in extra.items()})
    return logits, batch


def test_policy_loss_hand_values_truncated_is():
    # No prox: r = 1, objective = A = 1. IS ratios exp(0.5) and e, the second capped at 2.
    logits, batch = _uniform_batch([-LOG3 - 0.5, -LOG3 - 1.0], [1.0, 1.0])
    cfg = PolicyLossConfig(tis_cap=2.0)
    loss, m = policy_loss(logits, batch, cfg)
    np.testing.assert_allclose(float(loss), -(math.exp(0.5) + 2.0) / 2, rtol=1e-6)
    np.testing.assert_allclose(float(m["is_ratio_max"]), math.e, rtol=1e-6)
    np.testing.assert_allclose(float(m["is_ratio_min"]), math.exp(0.5), rtol=1e-6)
    np.testing.assert_allclose(float(m["is_ratio_mean"]), (math.e + math.exp(0.5)) / 2, rtol=1e-6)
    assert float(m["tis_capped_frac"]) == 0.5
    # k1 mismatch: mean(behavior - prox) = mean(-0.5, -1.0).
    np.testing.assert_allclose(float(m["mismatch_kl"]), -0.75, rtol=1e-6)
    k3 = ((math.exp(0.5) - 0.5 - 1) + (math.e - 1.0 - 1)) / 2
    np.testing.assert_allclose(float(m["mismatch_kl_k3"]), k3, rtol=1e-6)
    np.testing.assert_allclose(float(m["entropy"]), LOG3, rtol=1e-6)
    assert float(m["clip_frac"]) == 0.0 and float(m["tokens"]) == 2.0
    # Without the cap the weights are 1 (no correction at all), but the metrics still report.
    loss_none, m_none = policy_loss(logits, batch, PolicyLossConfig(tis_cap=None))
    np.testing.assert_allclose(float(loss_none), -1.0, rtol=1e-6)
    assert float(m_none["tis_capped_frac"]) == 0.0
    np.testing.assert_allclose(float(m_none["is_ratio_max"]), math.e, rtol=1e-6)


def test_policy_loss_hand_values_ppo_clip():
    # prox chosen so r = exp(logp - prox) is 1.5, 1.5, 0.5, 0.5 with A = +1, -1, +1, -1:
    #  r=1.5, A=+1 -> min(1.5, 1.28) = 1.28 (clip binds)
    #  r=1.5, A=-1 -> min(-1.5, -1.28) = -1.5
    #  r=0.5, A=+1 -> min(0.5, 0.8) = 0.5
    #  r=0.5, A=-1 -> min(-0.5, -0.8) = -0.8 (clip binds)
    lp = -LOG3
    prox = [lp - math.log(1.5)] * 2 + [lp - math.log(0.5)] * 2
    logits, batch = _uniform_batch(
        behavior=prox, adv=[1.0, -1.0, 1.0, -1.0], proximal_logprobs=prox
    )
    cfg = PolicyLossConfig(eps_low=0.2, eps_high=0.28, tis_cap=2.0)
    loss, m = policy_loss(logits, batch, cfg)
    np.testing.assert_allclose(float(loss), -(1.28 - 1.5 + 0.5 - 0.8) / 4, rtol=1e-5)
    assert float(m["clip_frac"]) == 0.5
    # behavior == prox: no mismatch, every IS ratio is 1.
    assert abs(float(m["mismatch_kl"])) < 1e-7 and float(m["is_ratio_max"]) == 1.0
    # Symmetric clip 0.6: 1.5 is inside [0.4, 1.6], 0.5 too: nothing binds.
    loss_wide, m_wide = policy_loss(logits, batch, PolicyLossConfig(eps_low=0.6, eps_high=0.6))
    np.testing.assert_allclose(float(loss_wide), -(1.5 - 1.5 + 0.5 - 0.5) / 4, atol=1e-6)
    assert float(m_wide["clip_frac"]) == 0.0


def test_policy_loss_hand_values_kl_k3():
    # r = 1, A = 0: only the KL term. ref - logp = d -> k3 = e^d - d - 1.
    d = [0.5, -1.0]
    logits, batch = _uniform_batch(
        [-LOG3, -LOG3], [0.0, 0.0], ref_logprobs=[-LOG3 + d[0], -LOG3 + d[1]]
    )
    loss, m = policy_loss(logits, batch, PolicyLossConfig(kl_coef=0.1))
    k3 = [math.exp(x) - x - 1 for x in d]
    np.testing.assert_allclose(float(m["kl_ref"]), sum(k3) / 2, rtol=1e-6)
    np.testing.assert_allclose(float(loss), 0.1 * sum(k3) / 2, rtol=1e-6)
    assert abs(float(m["pg_loss"])) < 1e-7
    # kl_coef = 0 never reads ref_logprobs and reports no kl_ref.
    _, m0 = policy_loss(
        logits,
        {k: v for k, v in batch.items() if k != "ref_logprobs"},
        PolicyLossConfig(kl_coef=0.0),
    )
    assert "kl_ref" not in m0


def test_policy_loss_unmasked_tokens_are_ignored_everywhere():
    # Token 1 is masked out but carries a huge IS ratio, advantage and KL: no effect.
    logits, batch = _uniform_batch(
        [-LOG3 - 0.25, -LOG3 - 30.0], [1.0, 50.0], mask=[1, 0], ref_logprobs=[-LOG3, 0.0]
    )
    loss, m = policy_loss(logits, batch, PolicyLossConfig(kl_coef=0.5))
    np.testing.assert_allclose(float(loss), -math.exp(0.25), rtol=1e-6)
    np.testing.assert_allclose(float(m["is_ratio_max"]), math.exp(0.25), rtol=1e-6)
    np.testing.assert_allclose(float(m["is_ratio_min"]), math.exp(0.25), rtol=1e-6)
    assert float(m["tis_capped_frac"]) == 0.0 and float(m["advantage_mean"]) == 1.0
    assert float(m["kl_ref"]) == 0.0 and float(m["tokens"]) == 1.0


# ----- aggregation -----------------------------------------------------------------------------


def test_aggregate_token_mean_seq_mean_and_drgrpo_by_hand():
    per = jnp.asarray([[1.0, 2.0, 3.0], [10.0, 20.0, 30.0], [7.0, 7.0, 7.0]], jnp.float32)
    mask = jnp.asarray([[1, 1, 1], [1, 0, 0], [0, 0, 0]], jnp.float32)
    tok = aggregate(per, mask, PolicyLossConfig(aggregation="token_mean"))
    np.testing.assert_allclose(float(tok), (1 + 2 + 3 + 10) / 4, rtol=1e-6)
    # seq_mean: rows (2.0, 10.0); the empty third row does not count.
    seq = aggregate(per, mask, PolicyLossConfig(aggregation="seq_mean"))
    np.testing.assert_allclose(float(seq), (2.0 + 10.0) / 2, rtol=1e-6)
    # drgrpo: sum over masked tokens / (B * T), whatever `aggregation` says.
    for agg in ("token_mean", "seq_mean"):
        dr = aggregate(per, mask, PolicyLossConfig(advantage="drgrpo", aggregation=agg))
        np.testing.assert_allclose(float(dr), 16.0 / 9.0, rtol=1e-6)
    # Nothing masked in: 0 for every mode.
    zero = jnp.zeros_like(mask)
    for cfg in (
        PolicyLossConfig(),
        PolicyLossConfig(aggregation="seq_mean"),
        PolicyLossConfig(advantage="drgrpo"),
    ):
        assert float(aggregate(per, zero, cfg)) == 0.0


def test_rollout_mean_weighs_each_rollout_once_by_hand():
    # Rows: rollout "a" split in two segments (rows 0 and 2: 3 + 1 tokens), rollout "b" (row
    # 1: 2 tokens), a padding row. Means: a = (1+2+3+10)/4 = 4, b = (7+7)/2 = 7 -> 5.5.
    per = jnp.asarray([[1.0, 2.0, 3.0], [7.0, 7.0, 7.0], [10.0, 20.0, 30.0], [4.0, 4.0, 4.0]])
    mask = jnp.asarray([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]], jnp.float32)
    rollout_tokens = jnp.broadcast_to(jnp.asarray([[4.0], [2.0], [4.0], [0.0]]), (4, 3))
    cfg = PolicyLossConfig(aggregation="rollout_mean")
    np.testing.assert_allclose(float(aggregate(per, mask, cfg, rollout_tokens)), 5.5, rtol=1e-6)
    np.testing.assert_allclose(float(normaliser(mask, cfg, rollout_tokens)), 2.0, rtol=1e-6)
    # token_mean would weigh rollout a by its 4 tokens: (6 + 14 + 10) / 6 = 5.
    np.testing.assert_allclose(float(aggregate(per, mask, PolicyLossConfig())), 5.0, rtol=1e-6)
    # Two micro-batches (rows 0-1, rows 2-3: rollout a straddles them), each weighted by its
    # normaliser as the trainer accumulates: still 5.5.
    parts = [(per[:2], mask[:2], rollout_tokens[:2]), (per[2:], mask[2:], rollout_tokens[2:])]
    num = sum(float(aggregate(p, m, cfg, r)) * float(normaliser(m, cfg, r)) for p, m, r in parts)
    den = sum(float(normaliser(m, cfg, r)) for _, m, r in parts)
    np.testing.assert_allclose(num / den, 5.5, rtol=1e-6)
    with pytest.raises(ValueError, match="rollout_tokens"):
        aggregate(per, mask, cfg)


def test_group_advantages_count_each_rollout_once():
    # Group g: rollout A split in two segments (reward 1), rollout B whole (reward 0). Per
    # rollout the group is {1, 0}: mean 0.5, std 0.5, so A's segments get +1 and B -1 (a
    # per-segment mean, 2/3, would favour the rollout that split).
    def seg(rollout_id: str, reward: float) -> Trajectory:
        return Trajectory(
            task_id="t",
            arm="real",
            env_backend="harness",
            status="ok",
            reward=reward,
            group_id="g",
            rollout_id=rollout_id,
        )

    used = [seg("A", 1.0), seg("B", 0.0), seg("A", 1.0)]
    adv = rollout_advantages(used, [1.0, 0.0, 1.0], PolicyLossConfig())
    np.testing.assert_allclose(
        adv, [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.5 / (0.5 + 1e-6)], rtol=1e-6
    )


def test_build_rl_batch_counts_each_rollouts_tokens():
    def episode(rollout_id: str, n_gen: int, reward: float) -> Trajectory:
        ids = list(range(1, 3 + n_gen))
        mask = [0, 0] + [1] * n_gen
        return Trajectory(
            task_id="t",
            arm="real",
            env_backend="harness",
            status="ok",
            reward=reward,
            turns=[Turn(agent_text="x", token_span=(2, 2 + n_gen))],
            token_ids=ids,
            loss_mask=mask,
            behavior_logprobs=[None, None] + [-1.0] * n_gen,
            policy_version=[None, None] + [0] * n_gen,
            rollout_id=rollout_id,
        )

    eps = [episode("a", 3, 1.0), episode("b", 2, 0.0), episode("a", 1, 1.0), episode("", 2, 0.0)]
    cfg = PolicyLossConfig(aggregation="rollout_mean")
    batch, _ = build_rl_batch(eps, rows=6, seq_len=8, cfg=cfg, version=0)
    assert batch["rollout_tokens"].shape == (6, 8)
    assert batch["rollout_tokens"][:, 0].tolist() == [4.0, 2.0, 4.0, 2.0, 0.0, 0.0]
    assert (batch["rollout_tokens"] == batch["rollout_tokens"][:, :1]).all()
    plain, _ = build_rl_batch(eps, rows=6, seq_len=8, cfg=PolicyLossConfig(), version=0)
    assert "rollout_tokens" not in plain


# ----- policy: against the loop reference --------------------------------------------------------

REF_CASES = {
    "default": (PolicyLossConfig(), False, False),
    "prox_clip": (PolicyLossConfig(eps_low=0.2, eps_high=0.28), True, False),
    "prox_no_tis": (PolicyLossConfig(tis_cap=None), True, False),
    "tis_cap_1": (PolicyLossConfig(tis_cap=1.0), True, False),
    "kl": (PolicyLossConfig(kl_coef=0.3), True, True),
    "seq_mean": (PolicyLossConfig(aggregation="seq_mean", kl_coef=0.1), True, True),
    "drgrpo": (PolicyLossConfig(advantage="drgrpo", eps_high=0.1), True, False),
    "drgrpo_no_prox": (PolicyLossConfig(advantage="drgrpo"), False, False),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", sorted(REF_CASES))
def test_policy_loss_matches_loop_reference(case, seed):
    cfg, prox, ref = REF_CASES[case]
    logits, batch = _random_policy_batch(seed, prox=prox, ref=ref)
    loss, m = policy_loss(jnp.asarray(logits), _jnp(batch), cfg)
    want_loss, want = ref_policy_loss(logits, batch, cfg)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-6)
    assert set(m) == set(want), sorted(set(m) ^ set(want))
    for k, v in want.items():
        np.testing.assert_allclose(float(m[k]), v, rtol=1e-5, atol=1e-6, err_msg=k)


def test_reference_cases_exercise_clipping_and_capping():
    """The random cases above are only worth something if they hit every branch."""
    hits = {"clip": 0, "cap": 0, "clip_not_binding": 0}
    for seed in (0, 1, 2):
        logits, batch = _random_policy_batch(seed, prox=True)
        _, m = ref_policy_loss(logits, batch, PolicyLossConfig())
        hits["clip"] += m["clip_frac"] > 0
        hits["cap"] += m["tis_capped_frac"] > 0
        hits["clip_not_binding"] += m["clip_frac"] < 1
    assert all(v > 0 for v in hits.values()), hits


# ----- gradients -------------------------------------------------------------------------------


def _analytic_grad(logits, batch, cfg):
    """Without prox, d loss / d logits = -w A m / norm * (onehot(target) - softmax)."""
    logits = np.asarray(logits, np.float64)
    B, T, V = logits.shape
    mask = np.asarray(batch["loss_mask"], np.float64)
    grad = np.zeros_like(logits)
    if cfg.advantage == "drgrpo":
        scale = np.full((B, T), 1.0 / (B * T))
    elif cfg.aggregation == "seq_mean":
        rows = mask.sum(1)
        n_rows = max((rows > 0).sum(), 1)
        scale = np.repeat((1.0 / np.maximum(rows, 1.0) / n_rows)[:, None], T, 1)
    else:
        scale = np.full((B, T), 1.0 / max(mask.sum(), 1.0))
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            lsm = _log_softmax(logits[b, t])
            tgt = int(batch["targets"][b, t])
            w = 1.0  # tis_cap None: no correction
            if cfg.tis_cap is not None:
                w = min(math.exp(lsm[tgt] - float(batch["behavior_logprobs"][b, t])), cfg.tis_cap)
            adv = float(batch["advantages"][b, t])
            dlogp = -np.exp(lsm)
            dlogp[tgt] += 1.0
            grad[b, t] = -w * adv * scale[b, t] * dlogp
    return grad


@pytest.mark.parametrize(
    "cfg",
    [
        PolicyLossConfig(),
        PolicyLossConfig(tis_cap=None),
        PolicyLossConfig(aggregation="seq_mean"),
        PolicyLossConfig(advantage="drgrpo"),
    ],
    ids=["token_mean", "no_tis", "seq_mean", "drgrpo"],
)
def test_policy_gradient_without_prox_is_w_times_advantage_times_dlogp(cfg):
    logits, batch = _random_policy_batch(5)
    grad = jax.grad(lambda x: policy_loss(x, _jnp(batch), cfg)[0])(jnp.asarray(logits))
    expected = _analytic_grad(logits, batch, cfg)
    assert np.abs(expected).max() > 1e-3  # not a vacuous comparison
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-7)


def test_policy_gradient_matches_finite_differences_with_prox_and_kl():
    """With prox and the KL term the loss is piecewise smooth: check jax.grad against central
    differences in float64 of the loop reference, at a point away from the clip kinks."""
    cfg = PolicyLossConfig(kl_coef=0.2, eps_low=0.2, eps_high=0.28)
    logits, batch = _random_policy_batch(7, prox=True, ref=True)
    grad = np.asarray(jax.grad(lambda x: policy_loss(x, _jnp(batch), cfg)[0])(jnp.asarray(logits)))
    x0 = logits.astype(np.float64)
    h = 1e-5
    fd = np.zeros_like(x0)
    for idx in np.ndindex(*x0.shape):
        up, dn = x0.copy(), x0.copy()
        up[idx] += h
        dn[idx] -= h
        fd[idx] = (ref_policy_loss(up, batch, cfg)[0] - ref_policy_loss(dn, batch, cfg)[0]) / (
            2 * h
        )
    assert np.abs(fd).max() > 1e-3
    np.testing.assert_allclose(grad, fd, rtol=1e-4, atol=1e-6)


def test_sft_gradient_is_softmax_minus_onehot_over_token_count():
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 1, (2, 3, 4)).astype(np.float32)
    targets = rng.integers(0, 4, (2, 3)).astype(np.int32)
    mask = np.array([[1, 0, 1], [1, 1, 0]], np.int32)
    batch = {"targets": jnp.asarray(targets), "loss_mask": jnp.asarray(mask)}
    grad = np.asarray(jax.grad(lambda x: sft_loss(x, batch)[0])(jnp.asarray(logits)))
    p = np.asarray(jax.nn.softmax(jnp.asarray(logits), -1))
    onehot = np.eye(4)[targets]
    expected = (p - onehot) * mask[..., None] / mask.sum()
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)
