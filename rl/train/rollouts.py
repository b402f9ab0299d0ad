"""From episodes to an RL batch: the `EpisodeSource` Protocol the RL loop pulls from, group
advantages, and `[B, T]` rows aligned with the SFT batch convention (`rl/data/datasets.py`).

One episode per row (so `seq_mean` aggregation is per episode) while the episodes fit the
rows; when a batch has more (a harness rollout split into several segments),
`rl.data.packing.pack_rows` puts several segments of one rollout into a row, each attending
only to itself (its own segment ids and positions; `seq_mean` then weighs the row as one).
Rows are padded to a fixed count and length, so the train step never recompiles.
`rl/orchestrator/buffer.py` implements `EpisodeSource` over live rollouts;
`InMemoryEpisodeSource` serves tests and benches.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from rl.data.outcome import success_trial, trial_metrics, unshaped_reward
from rl.data.packing import pack_rows, replay_segments
from rl.data.trajectory import Trajectory
from rl.train.config import PolicyLossConfig

USABLE = ("ok", "truncated")


class EpisodeSource(Protocol):
    """Batches of finished episodes for the RL trainer."""

    async def next_batch(self) -> list[Trajectory]:
        """The next `batch_size` episodes (whole groups); raises if rollouts failed."""
        ...

    async def set_version(self, version: int) -> None:
        """The trainer now holds (and servers serve) policy `version`."""
        ...

    async def close(self) -> None: ...


class InMemoryEpisodeSource:
    """`make_batch(version) -> episodes`, called once per `next_batch`."""

    def __init__(self, make_batch: Callable[[int], list[Trajectory]]):
        self.make_batch, self.version, self.versions_seen = make_batch, 0, [0]

    async def next_batch(self) -> list[Trajectory]:
        return self.make_batch(self.version)

    async def set_version(self, version: int) -> None:
        self.version = version
        self.versions_seen.append(version)

    async def close(self) -> None:
        pass


def group_advantages(
    rewards: Sequence[float], group_ids: Sequence[str], cfg: PolicyLossConfig
) -> np.ndarray:
    """Per-episode advantage: reward minus its group's mean (GRPO divides by the group's std
    + 1e-6 when `std_norm`; Dr.GRPO never does). A group of one gets 0."""
    rewards_arr = np.asarray(rewards, dtype=np.float64)
    by_group: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        by_group[g].append(i)
    adv = np.zeros(len(rewards_arr), dtype=np.float64)
    for idx in by_group.values():
        r = rewards_arr[idx]
        centred = r - r.mean()
        if cfg.advantage == "grpo" and cfg.std_norm:
            centred = centred / (r.std() + 1e-6)
        adv[idx] = centred
    return adv.astype(np.float32)


def trial_advantages(
    episodes: Sequence[Trajectory], cfg: PolicyLossConfig
) -> dict[int, np.ndarray]:
    """Per-token advantages of the `per_trial` multi-trial episodes among `episodes` (by
    position): trial k's reward minus the mean of trial k's rewards across the episodes of the
    group that reached trial k (GRPO/Dr.GRPO as `group_advantages`), on that trial's turns'
    generated tokens. Other episodes are not in the result (one advantage per episode)."""
    rows = [i for i, t in enumerate(episodes) if t.trials and t.trial_reward == "per_trial"]
    keys, rewards, where = [], [], []
    for i in rows:
        t = episodes[i]
        for trial in t.trials:
            r = trial.reward if trial.reward is not None else cfg.truncated_reward
            keys.append(f"{t.group_id or t.task_id}#trial{trial.index}")
            rewards.append(float(r))
            where.append((i, trial))
    adv = group_advantages(rewards, keys, cfg) if rewards else []
    out = {i: np.zeros(len(episodes[i].token_ids), np.float32) for i in rows}
    for (i, trial), a in zip(where, adv, strict=True):
        for turn in episodes[i].turns[trial.start_turn : trial.end_turn]:
            if turn.token_span is not None:
                out[i][turn.token_span[0] : turn.token_span[1]] = a
    return out


@dataclass
class BatchStats:
    """What went into an RL batch (and what did not, and why)."""

    episodes: int = 0
    used: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    reward_mean: float = 0.0
    """Mean reward trained on over the used episodes: the task's plus any shaping terms."""
    task_reward_mean: float = 0.0
    """Mean task reward over the used episodes, before shaping (`reward_mean` without
    shaping)."""
    shaping: dict[str, float] = field(default_factory=dict)
    """Mean of each shaping term over the used episodes (`shaping_<term>` in the record; an
    episode without the term counts 0); empty when no used episode was shaped."""
    success_rate: float = 0.0
    """Share of used episodes whose task reward reached 1 (in some trial); shaping never
    counts."""
    tokens: int = 0
    """Generated (trained) tokens."""
    truncated_rows: int = 0
    staleness_mean: float = 0.0
    """Mean over generated tokens of (trainer version - version that sampled the token)."""
    staleness_max: int = 0
    zero_variance_groups: int = 0
    """Groups whose episodes all got the same reward (no learning signal)."""
    episode_tokens_mean: float = 0.0
    truncated_context: int = 0
    """Episodes of the batch (used or not) that ended `truncated` because their context was
    full: with several trials, the later trials they never reached."""
    trials: dict[str, float] = field(default_factory=dict)
    """Multi-trial batches: `success_by_trial_k` (share of the used episodes that succeeded by
    trial k) and `adaptation_delta` (by trial 2 minus by trial 1), as the evaluations report
    them (`rl.data.outcome.trial_metrics`); empty for single-trial episodes."""

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("trials", "shaping")}
        return {**out, **{f"shaping_{k}": v for k, v in self.shaping.items()}, **self.trials}


def _reward(t: Trajectory, cfg: PolicyLossConfig) -> float | None:
    if t.reward is None and t.status == "truncated":
        return cfg.truncated_reward
    return t.reward


def _task_reward(t: Trajectory, cfg: PolicyLossConfig) -> float:
    """`_reward` before shaping (of a used episode, so never None)."""
    task = unshaped_reward(t)
    return float(cfg.truncated_reward if task is None else task)


def _skip_reason(t: Trajectory, cfg: PolicyLossConfig) -> str | None:
    if t.exclusion is not None:
        return t.exclusion.kind
    if t.status not in USABLE:
        return f"status_{t.status}"
    if _reward(t, cfg) is None:
        return "no_reward"
    if t.source != "sampler" or t.behavior_logprobs is None:
        return "no_behavior_logprobs"
    if not any(t.loss_mask):
        return "no_generated_tokens"
    return None


def rollout_advantages(
    used: Sequence[Trajectory], rewards: Sequence[float], cfg: PolicyLossConfig
) -> list[float]:
    """Group-relative advantages with one sample per rollout: the segments of a harness
    rollout (sharing `rollout_id`) count once in their group's mean and std, and each gets
    its rollout's advantage. Episodes without a rollout id are their own rollout."""
    keys = [t.rollout_id or f"\0row{i}" for i, t in enumerate(used)]
    first: dict[str, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    order = list(first)
    adv = group_advantages(
        [rewards[first[k]] for k in order],
        [used[first[k]].group_id or used[first[k]].task_id for k in order],
        cfg,
    )
    by_key = dict(zip(order, adv, strict=True))
    return [by_key[k] for k in keys]


def build_rl_batch(
    episodes: Sequence[Trajectory],
    *,
    rows: int,
    seq_len: int,
    cfg: PolicyLossConfig,
    version: int,
    pad_id: int = 0,
    row_multiple: int | None = None,
) -> tuple[dict[str, np.ndarray], BatchStats]:
    """`[rows, seq_len]` arrays `tokens, targets, loss_mask, segment_ids, positions,
    behavior_logprobs, advantages` from `episodes` (unusable ones are skipped and counted;
    extra episodes beyond `rows` are an error, the loop sizes batches).

    `row_multiple` (the trainer's data-parallel size x gradient accumulation): where the loss
    is the mean over the batch's tokens (`token_mean`, not Dr.GRPO's constant) and no episode
    carries compaction epochs, the episodes are packed densely (`pack_rows(dense=True)`) and
    the batch takes only the rows they need (`dense_rows`: in steps of an eighth of `rows`):
    the same loss and gradient from a fraction of the positions. A few row counts means a few
    compiled step shapes. 64 multi-turn `fileops` episodes (~700 tokens each, up to 1,536)
    pack into ~35 rows of 1,536: the step takes 40 rows instead of 64."""
    stats = BatchStats(episodes=len(episodes))
    stats.truncated_context = sum(
        t.status == "truncated" and (t.reason or "").startswith("context full") for t in episodes
    )
    used: list[Trajectory] = []
    skipped: dict[str, int] = defaultdict(int)
    for t in episodes:
        reason = _skip_reason(t, cfg)
        if reason:
            skipped[reason] += 1
        else:
            used.append(t)
    dense = (
        row_multiple is not None
        and cfg.aggregation == "token_mean"
        and cfg.advantage != "drgrpo"
        and not any(t.kv_epochs for t in used)
    )
    layout = pack_rows(used, rows=rows, seq_len=seq_len, dense=dense)
    if layout is None:
        raise ValueError(
            f"{len(used)} usable episodes do not fit in {rows} rows, even with the segments of "
            "each rollout packed together"
        )
    if dense:
        rows = dense_rows(len(layout), row_multiple, rows)
    stats.skipped, stats.used = dict(skipped), len(used)
    T = seq_len
    batch = {
        "tokens": np.full((rows, T), pad_id, np.int32),
        "targets": np.full((rows, T), pad_id, np.int32),
        "loss_mask": np.zeros((rows, T), np.int32),
        "segment_ids": np.zeros((rows, T), np.int32),
        "positions": np.zeros((rows, T), np.int32),
        "behavior_logprobs": np.zeros((rows, T), np.float32),
        "advantages": np.zeros((rows, T), np.float32),
    }
    if not used:
        return batch, stats
    rewards = [float(_reward(t, cfg)) for t in used]
    adv = rollout_advantages(used, rewards, cfg)
    per_trial = trial_advantages(used, cfg)
    stale: list[int] = []
    for row, members in enumerate(layout):
        at = seg = 0
        cut = False
        for e in members:
            t, a = used[e], adv[e]
            # Each sequence the server computed becomes a segment of the row (one without
            # `context_resets`): token k of the sequence predicts token k + 1, which is
            # trained here only if it is one of the segment's own tokens.
            parts = []
            for idx, own, _ in replay_segments(t):
                k = np.arange(1, len(idx))
                own_k = k >= max(own, 1)
                parts.append((idx, np.where(own_k, idx[k], -1)))
            cut = cut or at + sum(len(idx) - 1 for idx, _ in parts) > T
            ids = np.asarray(t.token_ids, np.int64)
            lmask = np.asarray(t.loss_mask, np.int32)
            blp_all = np.asarray(
                [x if x is not None else 0.0 for x in t.behavior_logprobs], np.float32
            )
            trial_adv = per_trial.get(e)
            for idx, trained in parts:
                n = min(len(idx) - 1, T - at)
                if n <= 0:
                    break
                seg += 1
                sl = slice(at, at + n)
                tgt, mine = idx[1 : n + 1], trained[:n]
                m = np.where(mine >= 0, lmask[tgt], 0).astype(np.int32)
                batch["tokens"][row, sl] = ids[idx[:n]]
                batch["targets"][row, sl] = ids[tgt]
                batch["loss_mask"][row, sl] = m
                batch["segment_ids"][row, sl] = seg
                batch["positions"][row, sl] = np.arange(n)
                batch["behavior_logprobs"][row, sl] = blp_all[tgt] * m
                if trial_adv is not None:  # each trial's tokens get its own trial's advantage
                    batch["advantages"][row, sl] = trial_adv[tgt] * m
                else:
                    batch["advantages"][row, sl] = a * m
                stale += [
                    version - t.policy_version[i]
                    for i, keep in zip(tgt, m, strict=True)
                    if keep and t.policy_version[i] is not None
                ]
                at += n
        stats.truncated_rows += cut
    groups: dict[str, list[float]] = defaultdict(list)
    for t, r in zip(used, rewards, strict=True):
        groups[t.group_id or t.task_id].append(r)
    stats.zero_variance_groups = sum(1 for g in groups.values() if len(set(g)) == 1)
    stats.reward_mean = float(np.mean(rewards))
    stats.task_reward_mean = float(np.mean([_task_reward(t, cfg) for t in used]))
    terms = sorted({name for t in used for name in t.shaping})
    stats.shaping = {k: float(np.mean([t.shaping.get(k, 0.0) for t in used])) for k in terms}
    stats.success_rate = float(np.mean([success_trial(t) is not None for t in used]))
    stats.tokens = int(batch["loss_mask"].sum())
    stats.staleness_mean = float(np.mean(stale)) if stale else 0.0
    stats.staleness_max = int(max(stale)) if stale else 0
    stats.episode_tokens_mean = float(np.mean([len(t.token_ids) for t in used]))
    if any(t.trials for t in used):
        tm = trial_metrics(used)
        stats.trials = {
            **{f"success_by_trial_{k + 1}": v for k, v in enumerate(tm["success_at"])},
            "adaptation_delta": tm["adaptation_delta"],
        }
    if any(t.kv_epochs for t in used):
        batch.update(kv_visibility(used, rows=rows, seq_len=T, layout=layout))
    if cfg.aggregation == "rollout_mean":
        keys = [used[members[0]] for members in layout]
        batch["rollout_tokens"] = rollout_tokens(keys, batch["loss_mask"], rows=rows)
    return batch, stats


def dense_rows(needed: int, multiple: int, rows: int) -> int:
    """The fewest rows that hold `needed` packed rows, in steps of an eighth of `rows` (rounded
    to `multiple`; below the first step, `multiple x 2^i`): few step shapes to compile.
    `rows` where `rows` is not a multiple of `multiple`."""
    if multiple <= 0 or rows % multiple:
        return rows
    step = max(multiple, rows // 8 // multiple * multiple)
    if needed <= step:
        out = multiple
        while out < needed:
            out *= 2
        return min(out, step)
    return min(rows, -(-needed // step) * step)


def rollout_tokens(
    episodes: Sequence[Trajectory], loss_mask: np.ndarray, *, rows: int
) -> np.ndarray:
    """[rows, T] float32: along row i (whose episodes are of `episodes[i]`'s rollout), the
    generated tokens in the batch of every row sharing its `rollout_id` (its own when it has
    none); 0 for padding rows. (Per token,
    like every batch array, so one batch sharding fits all.)"""
    keys = [t.rollout_id or f"\0row{i}" for i, t in enumerate(episodes)]
    per_row = loss_mask.sum(axis=1)
    totals: dict[str, float] = defaultdict(float)
    for i, k in enumerate(keys):
        totals[k] += float(per_row[i])
    out = np.zeros((rows, loss_mask.shape[1]), np.float32)
    for i, k in enumerate(keys):
        out[i, :] = totals[k]
    return out


def kv_visibility(
    episodes: Sequence[Trajectory],
    *,
    rows: int,
    seq_len: int,
    layout: Sequence[Sequence[int]] | None = None,
) -> dict:
    """The arrays of `rl.model.transformer.KVVisibility` for rows of `episodes` (row i holds
    the episodes `layout[i]`, by default episode i alone): `kv_epoch` [rows, T], `kv_start`
    [rows, E], `kv_kept` [rows, E, T] (E: the most epochs of any row). Every segment of a row
    (`replay_segments`, episode after episode) opens with a plain epoch; an episode's
    `kv_epochs` fall in the segment whose own tokens they start in, whose positions are token
    indices (the first segment, or a reset that re-sent the whole prefix), shifted by where
    the segment begins in the row. Plain epochs see everything of their segment: the row's
    segment ids keep the segments apart."""
    T = seq_len
    if layout is None:
        layout = [[i] for i in range(len(episodes))]
    layouts = []
    for members in layout:
        epochs, off = [], 0
        for t in (episodes[i] for i in members):
            segs = replay_segments(t)
            ends = [lo for _, _, lo in segs[1:]] + [len(t.token_ids) + 1]
            for (idx, _, lo), hi in zip(segs, ends, strict=True):
                epochs.append((off, []))
                for ep in t.kv_epochs:
                    if lo <= ep["start"] < hi:
                        kept = [(off + a, off + b) for a, b in ep["kept"]]
                        epochs.append((off + int(ep["start"]), kept))
                off += len(idx) - 1
        layouts.append(epochs)
    E = max([len(e) for e in layouts] + [1])
    epoch = np.zeros((rows, T), np.int32)
    start = np.zeros((rows, E), np.int32)
    kept = np.zeros((rows, E, T), bool)
    for row, epochs in enumerate(layouts):
        for e, (s, ranges) in enumerate(epochs):
            s = min(s, T)
            start[row, e] = s
            epoch[row, s:] = e
            for a, b in ranges:
                kept[row, e, min(a, T) : min(b, T)] = True
    return {"kv_epoch": epoch, "kv_start": start, "kv_kept": kept}
