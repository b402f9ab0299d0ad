"""How an episode's tokens sit in training rows, shared by the trainer's batch builder
(`rl.train.rollouts.build_rl_batch`) and the sources that size batches before it
(`rl.orchestrator.harness.HarnessSource`): the sequences the server computed it in
(`replay_segments`), the positions they take (`replay_length`) and which episodes share a
row (`pack_rows`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rl.data.trajectory import Trajectory


def replay_segments(t: Trajectory) -> list[tuple[np.ndarray, int, int]]:
    """The sequences the server computed `t` in, as training replays them: `(indices into
    t.token_ids in sequence order, how many of them lead as re-sent context, the index of its
    first own token)`. One `(all, 0, 0)` without `context_resets`; each reset adds its context
    ranges followed by its own tokens (up to the next reset). A reset with no own tokens adds
    nothing."""
    n = len(t.token_ids)
    bounds = [0, *(int(r["start"]) for r in t.context_resets), n]
    out = []
    for j in range(len(bounds) - 1):
        lo, hi = bounds[j], bounds[j + 1]
        if hi <= lo:
            continue
        ctx = [] if j == 0 else [np.arange(a, b) for a, b in t.context_resets[j - 1]["context"]]
        lead = sum(len(c) for c in ctx)
        out.append((np.concatenate([*ctx, np.arange(lo, hi)]).astype(np.int64), lead, lo))
    return out


def replay_length(t: Trajectory) -> int:
    """The row positions `t` takes (`replay_segments`: each sequence's tokens but its last)."""
    return sum(len(idx) - 1 for idx, _, _ in replay_segments(t))


def pack_rows(
    episodes: Sequence[Trajectory], *, rows: int, seq_len: int, dense: bool = False
) -> list[list[int]] | None:
    """Which episodes (by index) go in each row; None when they do not fit in `rows`.

    One episode per row while there are no more episodes than rows. Otherwise the segments of
    each harness rollout (sharing `rollout_id`; an episode without one is its own rollout)
    are packed into as few rows as fit `seq_len` (first fit, longest first), never two
    rollouts in one row: a row then holds one rollout's advantage and `rollout_mean` weights
    stay per rollout. A segment longer than `seq_len` keeps a row to itself (and is cut, as
    any long episode is). Packing changes only what sits side by side in a row: each segment
    keeps its own segment ids and positions, so no token attends across segments.

    `dense`: every episode is packed so, whoever's rollout it is (as few rows as fit, even
    with fewer episodes than rows): for losses whose value does not depend on which tokens
    share a row (`token_mean`), so the trainer can take fewer rows."""
    if len(episodes) <= rows and not dense:
        return [[i] for i in range(len(episodes))]
    by_rollout: dict[str, list[int]] = {}
    for i, t in enumerate(episodes):
        key = "" if dense else (t.rollout_id or f"\0row{i}")
        by_rollout.setdefault(key, []).append(i)
    layout: list[list[int]] = []
    for members in by_rollout.values():
        bins: list[tuple[int, list[int]]] = []  # (free positions, episodes)
        for i in sorted(members, key=lambda i: -replay_length(episodes[i])):
            n = replay_length(episodes[i])
            for b, (free, held) in enumerate(bins):
                if n <= free:
                    bins[b] = (free - n, [*held, i])
                    break
            else:
                bins.append((seq_len - n, [i]))
        layout += [sorted(held) for _, held in bins]
    return layout if len(layout) <= rows else None
