"""rl/train/rollouts.py: group advantages against a loop, RL batches from real trajectories,
harness segments packed into rows (rl/data/packing.py)."""

import dataclasses
import math

import numpy as np
import pytest

from rl.data.packing import pack_rows, replay_length
from rl.data.trajectory import Exclusion, Trajectory, Turn, validate
from rl.train.config import PolicyLossConfig
from rl.train.rollouts import (
    BatchStats,
    EpisodeSource,
    InMemoryEpisodeSource,
    build_rl_batch,
    group_advantages,
)

# ----- group advantages ------------------------------------------------------------------------


def ref_advantages(rewards, group_ids, cfg):
    out = []
    for i, g in enumerate(group_ids):
        members = [rewards[j] for j in range(len(rewards)) if group_ids[j] == g]
        mean = sum(members) / len(members)
        a = rewards[i] - mean
        if cfg.advantage == "grpo" and cfg.std_norm:
            std = math.sqrt(sum((r - mean) ** 2 for r in members) / len(members))
            a = a / (std + 1e-6)
        out.append(a)
    return out


ADV_CFGS = {
    "grpo_std": PolicyLossConfig(advantage="grpo", std_norm=True),
    "grpo_nostd": PolicyLossConfig(advantage="grpo", std_norm=False),
    "drgrpo": PolicyLossConfig(advantage="drgrpo"),
    "drgrpo_std_flag_ignored": PolicyLossConfig(advantage="drgrpo", std_norm=True),
}


@pytest.mark.parametrize("name", sorted(ADV_CFGS))
def test_group_advantages_match_a_loop(name):
    cfg = ADV_CFGS[name]
    rng = np.random.default_rng(0)
    groups = ["a", "b", "a", "c", "b", "a", "c", "c", "d", "b"]  # interleaved, unequal sizes
    rewards = [float(x) for x in rng.normal(0, 2, len(groups))]
    got = group_advantages(rewards, groups, cfg)
    assert got.dtype == np.float32 and got.shape == (len(groups),)
    np.testing.assert_allclose(got, ref_advantages(rewards, groups, cfg), rtol=1e-5, atol=1e-6)


def test_group_advantages_hand_values():
    # Group of 4 with rewards 1, 0, 0, 1: mean .5, std .5.
    rewards, groups = [1.0, 0.0, 0.0, 1.0], ["g"] * 4
    a = 0.5 / (0.5 + 1e-6)
    np.testing.assert_allclose(
        group_advantages(rewards, groups, PolicyLossConfig(std_norm=True)),
        [a, -a, -a, a],
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        group_advantages(rewards, groups, PolicyLossConfig(advantage="drgrpo")),
        [0.5, -0.5, -0.5, 0.5],
        rtol=1e-6,
    )


@pytest.mark.parametrize("name", sorted(ADV_CFGS))
def test_singleton_groups_and_equal_rewards_get_zero(name):
    cfg = ADV_CFGS[name]
    got = group_advantages([3.0, 7.0, 2.0, 2.0, 2.0], ["x", "y", "z", "z", "z"], cfg)
    np.testing.assert_array_equal(got, np.zeros(5, np.float32))
    assert np.all(np.isfinite(got))


# ----- trajectories ----------------------------------------------------------------------------


def make_traj(
    *,
    prompt_len=3,
    gens=((4, 5),),
    obs_len=2,
    reward=1.0,
    group="g0",
    task="t0",
    status="ok",
    reason=None,
    versions=None,
    exclusion=None,
    first_id=10,
):
    """A valid sampler trajectory: `prompt_len` prompt ids, then per turn `n` generated ids
    (behavior logprob -0.1 * (k + 1) for the k-th generated token of the episode) followed by
    `obs_len` observation ids (not after the last turn). `gens` is ((n, version), ...)."""
    ids = list(range(first_id, first_id + prompt_len))
    mask, logp, version = [0] * prompt_len, [None] * prompt_len, [None] * prompt_len
    turns = []
    k = 0
    for i, (n, v) in enumerate(gens):
        start = len(ids)
        ids += [first_id + len(ids) + j for j in range(n)]
        mask += [1] * n
        logp += [-0.1 * (k + j + 1) for j in range(n)]
        version += [v] * n
        k += n
        turns.append(Turn(agent_text=f"reply {i}", command="ls", token_span=(start, start + n)))
        if i + 1 < len(gens):
            ids += [first_id + len(ids) + j for j in range(obs_len)]
            mask += [0] * obs_len
            logp += [None] * obs_len
            version += [None] * obs_len
    if versions is not None:
        version = versions
    t = Trajectory(
        task_id=task,
        arm="closed_loop",
        env_backend="simulated",
        status=status,
        reason=reason,
        reward=reward,
        group_id=group,
        turns=turns,
        source="sampler",
        token_ids=ids,
        loss_mask=mask,
        behavior_logprobs=logp,
        policy_version=version,
        tokenizer="byte",
        exclusion=exclusion,
    )
    validate(t)
    return t


CFG = PolicyLossConfig(advantage="drgrpo")  # advantages = reward - group mean, easy to read


def test_rows_are_shifted_and_aligned_with_targets():
    # 3 prompt ids, 2 generated (v1), 2 obs ids, 3 generated (v2): 10 ids.
    t = make_traj(gens=((2, 1), (3, 2)), reward=1.0, group="g")
    u = make_traj(gens=((1, 2),), reward=0.0, group="g", first_id=100)
    batch, stats = build_rl_batch([t, u], rows=4, seq_len=12, cfg=CFG, version=3)
    assert set(batch) == {
        "tokens",
        "targets",
        "loss_mask",
        "segment_ids",
        "positions",
        "behavior_logprobs",
        "advantages",
    }
    for k, v in batch.items():
        assert v.shape == (4, 12), k
    ids = t.token_ids
    n = len(ids) - 1
    np.testing.assert_array_equal(batch["tokens"][0, :n], ids[:-1])
    np.testing.assert_array_equal(batch["targets"][0, :n], ids[1:])
    np.testing.assert_array_equal(batch["loss_mask"][0, :n], t.loss_mask[1:])
    assert batch["loss_mask"][0].sum() == 5 == sum(t.loss_mask)
    np.testing.assert_array_equal(batch["segment_ids"][0], [1] * n + [0] * (12 - n))
    np.testing.assert_array_equal(batch["positions"][0, :n], np.arange(n))
    # behavior logprob of target j is the one stored at token j + 1, and 0 where not trained.
    want_blp = [x if x is not None else 0.0 for x in t.behavior_logprobs[1:]]
    np.testing.assert_allclose(batch["behavior_logprobs"][0, :n], want_blp, rtol=1e-6)
    # Advantage (drgrpo: 1 - 0.5) on exactly the trained targets.
    np.testing.assert_allclose(batch["advantages"][0, :n], 0.5 * np.asarray(t.loss_mask[1:]))
    np.testing.assert_allclose(
        batch["advantages"][1, : len(u.token_ids) - 1], -0.5 * np.asarray(u.loss_mask[1:])
    )
    # Every generated target in row 0 is a generated id of the trajectory.
    gen_ids = [i for i, m in zip(ids, t.loss_mask, strict=True) if m]
    assert list(batch["targets"][0][batch["loss_mask"][0] == 1]) == gen_ids
    # The tail of the used rows and the two padding rows are all zeros.
    for k in batch:
        assert not batch[k][0, n:].any(), k
        assert not batch[k][2:].any(), k
    assert stats.used == 2 and stats.episodes == 2 and stats.skipped == {}
    assert stats.tokens == 6 and stats.truncated_rows == 0
    assert stats.reward_mean == 0.5 and stats.success_rate == 0.5
    assert stats.episode_tokens_mean == (10 + 4) / 2


def test_pad_id_fills_tokens_and_targets_only():
    t = make_traj(gens=((2, 0),))
    batch, _ = build_rl_batch([t], rows=2, seq_len=8, cfg=CFG, version=0, pad_id=7)
    n = len(t.token_ids) - 1
    assert (batch["tokens"][0, n:] == 7).all() and (batch["targets"][1] == 7).all()
    assert not batch["segment_ids"][1].any() and not batch["loss_mask"][1].any()


def test_long_episode_is_truncated_to_seq_len():
    t = make_traj(prompt_len=3, gens=((6, 0),))  # 9 ids -> 8 targets
    batch, stats = build_rl_batch([t], rows=1, seq_len=5, cfg=CFG, version=2)
    np.testing.assert_array_equal(batch["tokens"][0], t.token_ids[:5])
    np.testing.assert_array_equal(batch["targets"][0], t.token_ids[1:6])
    np.testing.assert_array_equal(batch["loss_mask"][0], [0, 0, 1, 1, 1])
    assert (batch["segment_ids"][0] == 1).all()
    assert stats.truncated_rows == 1 and stats.tokens == 3
    # Staleness only over the tokens that made it into the row.
    assert stats.staleness_mean == 2.0 and stats.staleness_max == 2
    # Exactly seq_len + 1 ids fit without truncation.
    t2 = make_traj(prompt_len=3, gens=((3, 0),))
    _, stats2 = build_rl_batch([t2], rows=1, seq_len=5, cfg=CFG, version=0)
    assert stats2.truncated_rows == 0


def test_staleness_stats_over_generated_tokens():
    # 2 tokens at v1 and 3 at v3 in one episode, 1 token at v4 in another; trainer at v5.
    t = make_traj(gens=((2, 1), (3, 3)), group="a")
    u = make_traj(gens=((1, 4),), group="b")
    _, stats = build_rl_batch([t, u], rows=2, seq_len=16, cfg=CFG, version=5)
    stale = [4, 4, 2, 2, 2, 1]
    assert stats.staleness_mean == pytest.approx(sum(stale) / len(stale))
    assert stats.staleness_max == 4


def test_skip_reasons_are_counted_and_rows_hold_only_usable_episodes():
    good = [make_traj(reward=float(i % 2), group="g", first_id=10 + 50 * i) for i in range(3)]
    bad = [
        make_traj(exclusion=Exclusion("masked_group", "a sibling failed")),
        make_traj(exclusion=Exclusion("dropped", "it failed")),
        make_traj(exclusion=Exclusion("stale", "admitted 3 versions before the trainer")),
        make_traj(status="error", reason="agent server 503", reward=None),
        make_traj(status="aborted", reason="shutdown", reward=0.0),
        make_traj(status="truncated", reason="turn limit", reward=None),
        make_traj(gens=()),  # no generated tokens
    ]
    rendered = make_traj()
    rendered.source, rendered.behavior_logprobs, rendered.policy_version = "rendered", None, None
    validate(rendered)
    episodes = [bad[0], good[0], bad[1], bad[2], good[1], bad[3], bad[4], rendered, bad[5]]
    episodes += [bad[6], good[2]]
    overlong_filtering = dataclasses.replace(CFG, truncated_reward=None)
    batch, stats = build_rl_batch(episodes, rows=4, seq_len=16, cfg=overlong_filtering, version=0)
    assert stats.episodes == 11 and stats.used == 3
    assert stats.skipped == {
        "masked_group": 1,
        "dropped": 1,
        "stale": 1,
        "status_error": 1,
        "status_aborted": 1,
        "no_reward": 1,
        "no_behavior_logprobs": 1,
        "no_generated_tokens": 1,
    }
    for row, t in enumerate(good):  # in order, first rows
        n = len(t.token_ids) - 1
        np.testing.assert_array_equal(batch["tokens"][row, :n], t.token_ids[:-1])
    assert not batch["segment_ids"][3].any()
    # Advantages come from the usable group members only: rewards 0, 1, 0 -> mean 1/3.
    np.testing.assert_allclose(batch["advantages"][1].max(), 1 - 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(batch["advantages"][0].min(), -1 / 3, rtol=1e-6)


def test_truncated_without_a_reward_counts_as_failure_by_default():
    good = make_traj(reward=1.0, group="g", first_id=10)
    cut = make_traj(status="truncated", reason="context full", reward=None, group="g")
    batch, stats = build_rl_batch([good, cut], rows=2, seq_len=16, cfg=CFG, version=0)
    assert stats.used == 2 and stats.skipped == {} and stats.reward_mean == 0.5
    assert batch["advantages"][1].min() < 0 < batch["advantages"][0].max()


def test_truncated_status_with_a_reward_is_used():
    t = make_traj(status="truncated", reason="context full", reward=0.0)
    _, stats = build_rl_batch([t], rows=1, seq_len=16, cfg=CFG, version=0)
    assert stats.used == 1 and stats.skipped == {}


def test_too_many_usable_episodes_raise():
    eps = [make_traj(group=f"g{i}") for i in range(3)]
    with pytest.raises(ValueError, match="3 usable episodes do not fit in 2 rows"):
        build_rl_batch(eps, rows=2, seq_len=16, cfg=CFG, version=0)
    # Unusable extras do not count against the rows.
    eps[2].exclusion = Exclusion("over_rows", "the batch had more segments than its 2 rows")
    _, stats = build_rl_batch(eps, rows=2, seq_len=16, cfg=CFG, version=0)
    assert stats.used == 2


def test_no_usable_episodes_gives_an_all_padding_batch():
    masked = make_traj(exclusion=Exclusion("masked_group", "a sibling failed"))
    batch, stats = build_rl_batch([masked], rows=2, seq_len=4, cfg=CFG, version=0)
    assert stats.used == 0 and stats.skipped == {"masked_group": 1}
    assert all(not v.any() for v in batch.values())
    assert stats.tokens == 0 and stats.staleness_max == 0


def test_advantages_use_grpo_std_norm_and_group_falls_back_to_task_id():
    cfg = PolicyLossConfig(advantage="grpo", std_norm=True)
    eps = [
        make_traj(reward=1.0, group="", task="task-a"),
        make_traj(reward=0.0, group="", task="task-a"),
        make_traj(reward=1.0, group="", task="task-b"),
        make_traj(reward=1.0, group="", task="task-b"),
    ]
    batch, stats = build_rl_batch(eps, rows=4, seq_len=16, cfg=cfg, version=0)
    want = group_advantages([1.0, 0.0, 1.0, 1.0], ["task-a", "task-a", "task-b", "task-b"], cfg)
    for row in range(4):
        m = batch["loss_mask"][row] == 1
        np.testing.assert_allclose(batch["advantages"][row][m], want[row], rtol=1e-6)
    assert want[0] == pytest.approx(1.0, rel=1e-5) and want[2] == 0.0
    assert stats.zero_variance_groups == 1
    assert stats.success_rate == 0.75


def test_batch_stats_to_dict():
    s = BatchStats(episodes=3, used=2, skipped={"dropped": 1})
    d = s.to_dict()
    assert d["episodes"] == 3 and d["skipped"] == {"dropped": 1} and "staleness_max" in d


# ----- episode source --------------------------------------------------------------------------


async def test_in_memory_episode_source_passes_the_version():
    calls = []

    def make(version):
        calls.append(version)
        return [make_traj(group=f"v{version}")]

    src: EpisodeSource = InMemoryEpisodeSource(make)
    first = await src.next_batch()
    await src.set_version(1)
    await src.set_version(2)
    second = await src.next_batch()
    await src.close()
    assert calls == [0, 2]
    assert first[0].group_id == "v0" and second[0].group_id == "v2"
    assert src.versions_seen == [0, 1, 2]


def test_context_resets_pack_each_computed_sequence_as_a_segment_training_each_token_once():
    # prompt 0-2; turn 0 generated 3-6, obs 7-8; turn 1 generated 9-12, obs 13-14; turn 2
    # generated 15-18. The server computed turn 1 from [prompt, turn 0 + obs] (nothing dropped
    # yet: one stream) and turn 2 from [prompt, turn 1 + obs] (turn 0 dropped: a reset).
    t = make_traj(gens=((4, 0), (4, 0), (4, 0)))
    assert len(t.token_ids) == 19
    t.context_resets = [{"start": 15, "context": [[0, 3], [9, 15]]}]
    validate(t)
    batch, stats = build_rl_batch([t], rows=1, seq_len=32, cfg=CFG, version=0)
    assert stats.truncated_rows == 0
    seg1, seg2 = list(range(15)), [0, 1, 2, *range(9, 19)]
    ids = np.asarray(t.token_ids)
    n1, n2 = len(seg1) - 1, len(seg2) - 1
    assert batch["tokens"][0, :n1].tolist() == ids[seg1[:-1]].tolist()
    assert batch["tokens"][0, n1 : n1 + n2].tolist() == ids[seg2[:-1]].tolist()
    assert batch["targets"][0, n1 : n1 + n2].tolist() == ids[seg2[1:]].tolist()
    assert batch["segment_ids"][0, : n1 + n2].tolist() == [1] * n1 + [2] * n2
    assert batch["segment_ids"][0, n1 + n2 :].tolist() == [0] * (32 - n1 - n2)
    assert batch["positions"][0, n1 : n1 + n2].tolist() == list(range(n2))
    # every generated token is trained exactly once, with its own behavior logprob: turns 0
    # and 1 in the first segment, turn 2 (15-18) in the second, where turn 1 is context only
    trained = [tgt for tgt, m in zip(batch["targets"][0], batch["loss_mask"][0], strict=True) if m]
    assert sorted(trained) == sorted(ids[np.asarray(t.loss_mask, bool)].tolist())
    lp = batch["behavior_logprobs"][0][batch["loss_mask"][0].astype(bool)]
    want = [x for x, m in zip(t.behavior_logprobs, t.loss_mask, strict=True) if m]
    np.testing.assert_allclose(lp, want, rtol=1e-6)
    assert batch["loss_mask"][0, n1 : n1 + 8].sum() == 0  # predicting the re-sent context
    assert stats.tokens == 12


def test_a_prefix_reset_keeps_its_kv_epochs_in_the_second_segment():
    # Compacted in the first stream (epoch at 9 kept [0, 3) only), then the session was lost
    # and reopened with the whole prefix (reset at 15), which compacted again at 17.
    t = make_traj(gens=((4, 0), (4, 0), (4, 0)))
    t.kv_epochs = [
        {"start": 0, "kept": []},
        {"start": 9, "kept": [[0, 3]]},
        {"start": 17, "kept": [[0, 5], [15, 17]]},
    ]
    t.context_resets = [{"start": 15, "context": [[0, 15]]}]
    validate(t)
    batch, _ = build_rl_batch([t], rows=1, seq_len=40, cfg=CFG, version=0)
    off = 14  # the first segment's 14 inputs (tokens 0-13)
    vis = {k: batch[k][0] for k in ("kv_epoch", "kv_start", "kv_kept")}
    starts = vis["kv_start"].tolist()
    assert starts[:5] == [0, 0, 9, off, off + 17]
    assert vis["kv_epoch"][10] == 2 and vis["kv_epoch"][off + 3] == 3
    assert vis["kv_epoch"][off + 17] == 4
    assert np.flatnonzero(vis["kv_kept"][4]).tolist() == [
        *range(off, off + 5),
        *range(off + 15, off + 17),
    ]
    # a reset that re-sent less than the whole prefix cannot carry epochs after it
    t.context_resets = [{"start": 15, "context": [[0, 3], [9, 15]]}]
    with pytest.raises(ValueError, match=r"context_resets\[0\]\.context"):
        validate(t)


# ----- packing a rollout's segments ------------------------------------------------------------


def segment(rollout: str, group: str, reward: float, n: int, first_id: int) -> Trajectory:
    """One segment of a harness rollout: 3 prompt ids and one turn of `n` generated ids."""
    t = make_traj(gens=((n, 0),), group=group, reward=reward, first_id=first_id)
    t.rollout_id = rollout
    return t


def test_segments_beyond_the_rows_share_their_rollouts_rows_each_attending_to_itself():
    # Rollout a: three short segments; rollout b: one. Four segments, two rows of 16: a's
    # three (6 + 5 + 4 positions) pack into one row, b keeps the other.
    a = [segment("a", "g", 1.0, n, 10 * (k + 1)) for k, n in enumerate((4, 3, 2))]
    b = segment("b", "g", 0.0, 5, 100)
    assert pack_rows([*a, b], rows=4, seq_len=16) == [[0], [1], [2], [3]]  # fits: one each
    assert pack_rows([*a, b], rows=2, seq_len=16) == [[0, 1, 2], [3]]
    assert pack_rows([*a, b], rows=2, seq_len=10) is None  # a needs 2 rows of 10, b one
    assert pack_rows([*a, b], rows=3, seq_len=10) == [[0, 2], [1], [3]]  # first fit, longest first
    cfg = PolicyLossConfig(advantage="drgrpo", aggregation="rollout_mean")
    batch, stats = build_rl_batch([*a, b], rows=2, seq_len=16, cfg=cfg, version=0)
    assert stats.used == 4 and stats.truncated_rows == 0
    lens = [replay_length(t) for t in a]
    assert lens == [6, 5, 4]
    assert batch["segment_ids"][0].tolist() == [1] * 6 + [2] * 5 + [3] * 4 + [0]
    assert batch["positions"][0].tolist() == [*range(6), *range(5), *range(4), 0]
    at = 0
    for t, n in zip(a, lens, strict=True):
        ids = np.asarray(t.token_ids)
        assert batch["tokens"][0, at : at + n].tolist() == ids[:-1].tolist()
        assert batch["targets"][0, at : at + n].tolist() == ids[1:].tolist()
        at += n
    # Every generated token trained once, each with its rollout's advantage (a: 1 - 0.5).
    assert int(batch["loss_mask"][0].sum()) == 4 + 3 + 2 and int(batch["loss_mask"][1].sum()) == 5
    m = batch["loss_mask"].astype(bool)
    assert set(batch["advantages"][0][m[0]].tolist()) == {0.5}
    assert set(batch["advantages"][1][m[1]].tolist()) == {-0.5}
    # rollout_mean: each row carries its rollout's generated-token count.
    assert batch["rollout_tokens"][0, 0] == 9 and batch["rollout_tokens"][1, 0] == 5


def test_fit_rows_leaves_out_only_what_does_not_fit_packed():
    from rl.orchestrator.harness import fit_rows

    a = [segment("a", "g", 1.0, 4, 10 * (k + 1)) for k in range(3)]  # 6 positions each
    b = [segment("b", "g", 0.0, 4, 100 + 10 * k) for k in range(2)]
    # Two rows of 12: a needs two rows, b one; one of a's segments must go, the earliest.
    assert fit_rows([*a, *b], rows=2, seq_len=12) == 1
    assert [t.exclusion and t.exclusion.kind for t in [*a, *b]] == ["over_rows"] + [None] * 4
    assert "2 rows of 12 tokens" in a[0].exclusion.reason
    _, stats = build_rl_batch([*a, *b], rows=2, seq_len=12, cfg=CFG, version=0)
    assert stats.used == 4 and stats.skipped == {"over_rows": 1}
    # Room for all: nothing is left out.
    fresh = [segment("c", "g", 1.0, 4, 10 * (k + 1)) for k in range(3)]
    assert fit_rows(fresh, rows=3, seq_len=12) == 0


def test_multi_trial_batches_report_success_by_trial_and_context_truncations():
    from rl.data.trajectory import Trial

    def two_trials(first: float, second: float | None, group: str) -> Trajectory:
        t = make_traj(gens=((3, 0), (3, 0)), group=group, reward=max(first, second or 0.0))
        t.trials = [Trial(0, 0, 1, reward=first), Trial(1, 1, 2, reward=second)]
        t.trial_reward = "per_trial"
        return t

    won_first = two_trials(1.0, None, "g0")
    won_second = two_trials(0.0, 1.0, "g0")
    lost = two_trials(0.0, 0.0, "g1")
    full = "context full (510 of 512 tokens) before turn 2"
    cut = make_traj(status="truncated", reason=full, reward=None, group="g1")
    _, stats = build_rl_batch(
        [won_first, won_second, lost, cut], rows=4, seq_len=32, cfg=CFG, version=0
    )
    d = stats.to_dict()
    assert stats.truncated_context == 1 and d["truncated_context"] == 1
    # Over the 4 used episodes (the truncated one counts as a failure).
    assert d["success_by_trial_1"] == 0.25 and d["success_by_trial_2"] == 0.5
    assert d["adaptation_delta"] == 0.25 and "trials" not in d
    _, single = build_rl_batch([make_traj()], rows=1, seq_len=32, cfg=CFG, version=0)
    assert "adaptation_delta" not in single.to_dict() and single.truncated_context == 0


# ----- dense packing (fewer rows for token_mean) -----------------------------------------------


def _segments_by_target(batch):
    """{first target id of a segment: (tokens, targets, loss_mask, advantages, behavior
    logprobs, positions)} over every segment of every row."""
    out = {}
    for r in range(len(batch["tokens"])):
        seg = batch["segment_ids"][r]
        for s in sorted(set(seg.tolist()) - {0}):
            at = seg == s
            key = int(batch["targets"][r][at][0])
            assert key not in out
            out[key] = tuple(
                batch[k][r][at].tolist()
                for k in ("tokens", "targets", "loss_mask", "advantages", "behavior_logprobs",
                          "positions")
            )  # fmt: skip
    return out


def test_dense_packing_holds_every_episode_as_one_per_row_does_in_fewer_rows():
    from rl.train.rollouts import dense_rows

    # Steps of 8 (an eighth of 64), and below 8 the powers of two times 4.
    assert [dense_rows(n, 4, 64) for n in (0, 1, 4, 5, 8, 9, 17, 33, 57, 64)] == [
        4, 4, 4, 8, 8, 16, 24, 40, 64, 64]  # fmt: skip
    assert dense_rows(3, 4, 6) == 6  # rows not a multiple: never shrink
    assert dense_rows(17, 8, 48) == 24  # an eighth of 48 is 6: steps of the multiple, 8
    assert dense_rows(3, 1, 16) == 4 and dense_rows(5, 1, 16) == 6  # steps of 2
    # 12 episodes of 2 groups (9-15 positions each) over 16 rows of 40 positions.
    eps = [
        make_traj(gens=((3 + i % 4, 0), (2 + i % 3, 0)), reward=float(i % 2), group=f"g{i % 2}",
                  task=f"t{i % 2}", first_id=1000 * (i + 1))
        for i in range(12)
    ]  # fmt: skip
    cfg = PolicyLossConfig()  # grpo, token_mean
    sparse, s_stats = build_rl_batch(eps, rows=16, seq_len=40, cfg=cfg, version=0)
    dense, d_stats = build_rl_batch(eps, rows=16, seq_len=40, cfg=cfg, version=0, row_multiple=2)
    assert sum(replay_length(t) for t in eps) == 138  # 4 rows of 40 at least
    assert len(pack_rows(eps, rows=16, seq_len=40, dense=True)) == 4
    assert dense["tokens"].shape == (4, 40) and sparse["tokens"].shape == (16, 40)
    # The same segments, token for token, with the same advantages: token_mean is a sum over
    # them divided by their count, whichever row each sits in.
    assert _segments_by_target(dense) == _segments_by_target(sparse)
    assert int(dense["loss_mask"].sum()) == int(sparse["loss_mask"].sum())
    assert d_stats.to_dict() == s_stats.to_dict()
    # Rows hold several episodes, each its own segment (no token attends across them).
    assert max(len(set(r.tolist()) - {0}) for r in dense["segment_ids"]) >= 3
    # Losses whose value depends on the rows keep one episode per row.
    for other in (PolicyLossConfig(aggregation="seq_mean"), PolicyLossConfig(advantage="drgrpo")):
        kept, _ = build_rl_batch(eps, rows=16, seq_len=40, cfg=other, version=0, row_multiple=2)
        assert kept["tokens"].shape == (16, 40)
