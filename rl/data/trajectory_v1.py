"""Reading schema 1 trajectory records: their control flags, kept in `meta` then, moved onto
the typed fields of schema 2 (`rl.data.trajectory.Trajectory.from_dict` calls `upgrade_v1`)."""

from __future__ import annotations

from typing import Any

_LEGACY_DROPPED = (
    ("reward_mode last_segment", "earlier_segment"),
    ("the server forgot", "unreplayable"),
    ("the batch had more segments", "over_rows"),
)
"""Schema 1 wrote `meta.dropped` as True (a failed episode, `drop_episode`) or as one of these
reasons; the kind each maps to."""


def upgrade_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A schema 1 record with its control flags moved from `meta` onto the typed fields."""
    meta = data.get("meta")
    if not isinstance(meta, dict):
        return data  # validation names the bad `meta`
    meta, data = dict(meta), dict(data)
    # `rl.data.trajectory.CONTROL_FIELDS` but `exclusion` (below); not imported: that module
    # imports this one
    for name in (
        "group_index",
        "admitted_version",
        "task_kind",
        "trial_reward",
        "gate_unit",
        "replica_down",
    ):
        if name in meta:
            data[name] = meta.pop(name)
    if "kind" in meta and data.get("task_kind") is None:  # `simloop pretrain-sim`'s command kind
        data["task_kind"] = meta.pop("kind")
    if "unit" in meta and meta.get("shadow"):  # a gated run's shadow replay
        data["gate_unit"] = meta.pop("unit")
    if data.get("task_kind") == "":
        data["task_kind"] = None
    masked, masked_reason = meta.pop("masked", None), meta.pop("masked_reason", None)
    dropped, stale = meta.pop("dropped", None), meta.pop("stale", None)
    exclusion = None
    if masked:
        exclusion = {"kind": "masked_group", "reason": masked_reason or "a sibling failed"}
    elif isinstance(dropped, str) and dropped.strip():
        kind = next((k for prefix, k in _LEGACY_DROPPED if dropped.startswith(prefix)), "dropped")
        exclusion = {"kind": kind, "reason": dropped}
    elif dropped:
        exclusion = {
            "kind": "dropped",
            "reason": "it failed (orchestrator.failed_sibling: "
            f"drop_episode): {data.get('reason') or data.get('status')}",
        }
    elif stale:
        exclusion = {"kind": "stale", "reason": f"admitted {stale} versions before the trainer"}
    if exclusion is not None:
        data["exclusion"] = exclusion
    data["meta"] = meta
    return data
