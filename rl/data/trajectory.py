"""The trajectory: one episode, the unit every stage trades (docs/architecture.md §4), with its
validator, JSON form and atomic JSONL shards.

A trajectory holds the episode's turns as text (what the agent wrote, the command, the real
observation and return code) and its token view for training. Token-view conventions:

- `token_ids[i]`, `loss_mask[i]`, `behavior_logprobs[i]`, `policy_version[i]` describe the same
  token. `loss_mask[i]` is 1 exactly on tokens the agent generated: the union of the turns'
  `token_span`s (half-open `[start, end)`), one span per turn, in order.
- `source="sampler"`: the ids came from the inference server. `behavior_logprobs[i]` is a finite
  float where `loss_mask[i]` is 1 and `None` (JSON `null`, never NaN: NaN is not JSON) elsewhere;
  `policy_version[i]` likewise, an int that never decreases along the episode.
- `source="rendered"`: the ids were rendered from text (imported or scripted episodes); no
  sampler ever produced them, so `behavior_logprobs` and `policy_version` are `None` as whole
  fields. Such trajectories serve SFT, never policy-gradient steps. The `imported` arm must be
  `rendered`, and only it may end `ok` without a reward (the source recorded no score).

Multi-trial episodes (`env.terminal.trials` > 1) list their `trials`: consecutive turn ranges
`[start_turn, end_turn)` covering every turn, each with its own reward, status and the hash of
the workspace it started from. A single-trial episode has none (as before trials existed).

What code decides on is a typed field (`group_index`, `admitted_version`, `task_kind`,
`trial_reward`, `gate_unit`, `replica_down`, `exclusion`); `meta` is provenance only (nothing
branches on it) and may not hold those names. Schema 1 files kept them in `meta`: the loader
moves them onto the fields (`rl.data.trajectory_v1.upgrade_v1`).

Reward shaping (`env.terminal.shaping`): `reward` is what training sees, the task's reward
plus the `shaping` terms; `task_reward` is the task's own, and success is decided on it alone
(`rl.data.outcome`: `success_trial`, `unshaped_reward`), so success rates are the same with
shaping on or off.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, NoReturn

from rl.data.chat import ROLES, ChatRenderer, Message, generation_prompt
from rl.data.outcome import shaped_reward
from rl.data.trajectory_v1 import upgrade_v1

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
"""2: the control flags are typed fields, no longer `meta` keys (schema 1 still loads)."""
ARMS = ("real", "replay", "closed_loop", "mixed", "imported")
STATUSES = ("ok", "truncated", "aborted", "timeout", "error")
SOURCES = ("sampler", "rendered")
ENV_ROLES = ("user", "tool", "system")
TRIAL_REWARDS = ("first_success", "per_trial")
"""How a multi-trial episode's `reward` and advantages read its trials (`env.terminal`)."""
EXCLUSION_KINDS = (
    "masked_group",
    "dropped",
    "stale",
    "unreplayable",
    "earlier_segment",
    "over_rows",
)
"""Why the trainer does not train on an episode: `masked_group`, a sibling of its group failed
(group-relative advantages need every sibling); `dropped`, it failed and is left out alone
(`orchestrator.failed_sibling: drop_episode`); `stale`, its group was admitted more than
`max_staleness` versions before the trainer; `unreplayable`, its tokens cannot be replayed
(runs from before `context_resets`: a compacted session the server recomputed); `earlier_segment`,
a harness rollout's earlier segment under `reward_mode: last_segment`; `over_rows`, the batch's
segments did not fit its rows even packed (`rl.data.packing.pack_rows`)."""
CONTROL_FIELDS = (
    "group_index",
    "admitted_version",
    "task_kind",
    "trial_reward",
    "gate_unit",
    "replica_down",
    "exclusion",
)
CONTROL_META_KEYS = (*CONTROL_FIELDS, "masked", "masked_reason", "dropped", "stale")
"""Names `meta` may not hold: the typed fields, and the schema 1 keys the loader maps onto
them (a harness's `meta` naming one is refused, so no file can mean two things)."""
_CONTAINERS = (
    ("group_id", str),
    ("instruction", str),
    ("setup_files", dict),
    ("prompt", list),
    ("turns", list),
    ("token_ids", list),
    ("loss_mask", list),
    ("meta", dict),
    ("rollout_id", str),
)
_TURN_CONTAINERS = (
    ("env_messages", list),
    ("timings", dict),
    ("flags", list),
    ("info", dict),
)

Arm = Literal["real", "replay", "closed_loop", "mixed", "imported"]
Status = Literal["ok", "truncated", "aborted", "timeout", "error"]
Source = Literal["sampler", "rendered"]


@dataclass
class Turn:
    """One agent reply and what the environment answered."""

    agent_text: str
    """The agent's reply as generated (the assistant message body)."""
    command: str | None = None
    """The command parsed from the reply; None when the reply had none (format error)."""
    observation: str | None = None
    """What running the command printed in the episode's env (None: not run, e.g. submit)."""
    exit_code: int | None = None
    """The command's return code; None where the source did not record it."""
    env_messages: list[Message] = field(default_factory=list)
    """The messages (role user or tool) the agent was shown next, exactly as rendered."""
    sim_observation: str | None = None
    """Replay arm: the simulator's output for the same command, beside the real one."""
    sim_exit_code: int | None = None
    """Replay arm: the return code the simulator predicted."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per phase, e.g. `agent_s`, `env_s`."""
    flags: list[str] = field(default_factory=list)
    """Pathology flags: `cap_hit`, `think_leak`, `repetition`, `timeout`, `format_error`, ..."""
    token_span: tuple[int, int] | None = None
    """`[start, end)` of the agent's generated ids in `token_ids`; None without a token view."""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Exclusion:
    """Why the trainer leaves an episode out; the episode is still stored, marked."""

    kind: str
    """One of `EXCLUSION_KINDS`."""
    reason: str
    """What happened, in words (for the run's reader; no code parses it)."""

    def __post_init__(self):
        if self.kind not in EXCLUSION_KINDS:
            raise ValueError(
                f"exclusion.kind={self.kind!r} is invalid: one of {list(EXCLUSION_KINDS)}"
            )
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError(f"exclusion.reason={self.reason!r} is invalid: a non-empty string")


@dataclass
class Trial:
    """One attempt of a multi-trial episode: `turns[start_turn:end_turn]`."""

    index: int
    start_turn: int
    end_turn: int
    reward: float | None = None
    """The task's reward for this attempt (None: it never finished, e.g. aborted)."""
    status: Status = "ok"
    """As an episode's: `ok` when it ended by a submission, else why not (`reason`)."""
    reason: str | None = None
    workspace_hash: str = ""
    """Hash of the workspace the trial started from (every trial starts from the same)."""


@dataclass
class Trajectory:
    """One episode; see the module docstring for the token-view invariants."""

    task_id: str
    arm: Arm
    env_backend: str
    """Where observations came from: `local`, `e2b`, `simulated`, or the import source."""
    status: Status
    reason: str | None = None
    """Why the episode ended as it did; required unless `status` is `ok`."""
    reward: float | None = None
    group_id: str = ""
    """Episodes sampled together for one task (group-relative advantages)."""
    instruction: str = ""
    """The task statement (what the simulator's system prompt quotes)."""
    setup_files: dict[str, str] = field(default_factory=dict)
    """Files in the working directory at the start."""
    prompt: list[Message] = field(default_factory=list)
    """The messages before the first agent turn (system prompt, task)."""
    turns: list[Turn] = field(default_factory=list)
    source: Source = "sampler"
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behavior_logprobs: list[float | None] | None = field(default_factory=list)
    policy_version: list[int | None] | None = field(default_factory=list)
    tokenizer: str | None = None
    """Which tokenizer produced `token_ids` (e.g. `byte`, or an HF path)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Provenance only (where it came from, what a harness reported): nothing decides on it,
    and it may not hold a name of `CONTROL_META_KEYS`."""
    trials: list[Trial] = field(default_factory=list)
    """Multi-trial episodes: the attempts, in order (empty for a single trial)."""
    kv_epochs: list[dict[str, Any]] = field(default_factory=list)
    """Compacted KV sessions (`serving.compaction`): what each token could see when it was
    produced, as epochs `{"start": s, "kept": [[a, b], ...]}` in order of `start`. A token at
    index i belongs to the last epoch with start <= i and saw the kept half-open ranges (all
    before s) plus every token from s to i. Empty: plain causal attention (no compaction)."""
    context_resets: list[dict[str, Any]] = field(default_factory=list)
    """Where the server computed the episode afresh from a context other than the stream so
    far, `{"start": s, "context": [[a, b], ...]}` in order of `start`: from token s (to the next
    reset) the tokens were computed in a new sequence holding the `context` ranges' tokens
    (sorted, disjoint, the last one ending at s), re-prefilled at positions 0, 1, ..., then
    tokens s, s+1, ... A client-kept session on vLLM that drops old turns (`markovian`,
    `serving.token_sessions`) resets at every call that drops one; a compacted session that a
    server forgot (or whose replica died) resets to `[[0, s]]` when it is reopened. Training
    replays each reset as its own segment of the row (`rl.train.rollouts`). `kv_epochs` starting
    after a reset are in that sequence's positions, so they may only follow a `[[0, s]]` reset.
    Empty: one stream from the first token."""
    rollout_id: str = ""
    """Segments of one harness rollout (`simloop middleware`) share it: `loss.aggregation:
    rollout_mean` weighs every rollout equally, however many segments it split into. Empty:
    the episode is its own rollout."""
    group_index: int | None = None
    """Position in its group (the canonical order sorts by it); None outside a sampled group."""
    admitted_version: int | None = None
    """The trainer's version when admission let the episode start (the staleness bound is
    checked against it); None when no admission controller ran it."""
    task_kind: str | None = None
    """The task's kind (`Task.kind`, e.g. a textops operation), what fidelity and SFT weights
    group by; None when unknown."""
    trial_reward: str | None = None
    """Multi-trial episodes: one of `TRIAL_REWARDS`, how `reward` and advantages read the trials
    (`per_trial`: per-trial advantages); None for a single trial."""
    gate_unit: str | None = None
    """The `gated` arm's routing unit of the task; None outside that arm."""
    replica_down: str | None = None
    """The server replica (URL) that went down under the episode, which aborted it."""
    exclusion: Exclusion | None = None
    """Why the trainer leaves it out (the first decision that did); None: trainable, as far as
    the orchestrator knows (the trainer still skips unusable statuses)."""
    task_reward: float | None = None
    """The task's own reward, before shaping; success is decided on it. None where no
    terminal env scored the episode (imports, replays, harness rollouts, older files): then
    `reward` is the task's. Set, `reward` is `shaped_reward(task_reward, shaping)`."""
    shaping: dict[str, float] = field(default_factory=dict)
    """The shaping terms (`envs.config.ShapingConfig`) that `reward` adds to `task_reward`, by
    name and signed (`format_bonus`, `turn_penalty`, `call_penalty`); empty without shaping."""

    def to_dict(self) -> dict[str, Any]:
        data = plain(self)
        for turn in data["turns"]:
            if turn["token_span"] is not None:
                turn["token_span"] = list(turn["token_span"])
        return {"schema": SCHEMA_VERSION, **data}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, check: bool = True) -> Trajectory:
        """Inverse of `to_dict`; unknown or missing keys raise ValueError naming them."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a trajectory must be a JSON object, got {type(data).__name__}")
        data = dict(data)
        schema = data.pop("schema", None)
        if schema == 1:
            data = upgrade_v1(data)
        elif schema != SCHEMA_VERSION:
            raise ValueError(
                f"schema={schema!r} is invalid: this simloop reads 1 and {SCHEMA_VERSION}"
            )
        exclusion = data.get("exclusion")
        if exclusion is not None:
            if not isinstance(exclusion, Mapping):
                raise ValueError(
                    f'exclusion={exclusion!r} is invalid: {{"kind": ..., "reason": ...}} or null'
                )
            data["exclusion"] = Exclusion(**_known(Exclusion, dict(exclusion), "exclusion"))
        raw_turns = data.get("turns", [])
        if not isinstance(raw_turns, list):
            raise ValueError(f"turns={type(raw_turns).__name__} is invalid: a list")
        data["turns"] = [_turn_from_dict(t, i) for i, t in enumerate(raw_turns)]
        raw_trials = data.get("trials", [])
        if not isinstance(raw_trials, list):
            raise ValueError(f"trials={type(raw_trials).__name__} is invalid: a list")
        data["trials"] = [_trial_from_dict(t, i) for i, t in enumerate(raw_trials)]
        traj = cls(**_known(cls, data, "trajectory"))
        if check:
            validate(traj)
        return traj


def _known(cls: type, data: dict[str, Any], where: str) -> dict[str, Any]:
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed {names}")
    required = [
        f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
    ]
    missing = [k for k in required if k not in data]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}")
    return data


def _turn_from_dict(data: Any, i: int) -> Turn:
    if not isinstance(data, Mapping):
        raise ValueError(f"turns[{i}] must be a JSON object, got {type(data).__name__}")
    data = _known(Turn, dict(data), f"turns[{i}]")
    span = data.get("token_span")
    if span is not None:
        if not (isinstance(span, list | tuple) and len(span) == 2):
            raise ValueError(f"turns[{i}].token_span={span!r} is invalid: [start, end] or null")
        data["token_span"] = (span[0], span[1])
    return Turn(**data)


def _trial_from_dict(data: Any, i: int) -> Trial:
    if not isinstance(data, Mapping):
        raise ValueError(f"trials[{i}] must be a JSON object, got {type(data).__name__}")
    return Trial(**_known(Trial, dict(data), f"trials[{i}]"))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def validate(traj: Trajectory) -> None:
    """Check every invariant; ValueError names the field (and the index) that breaks one."""

    def fail(name: str, value: Any, allowed: str) -> NoReturn:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise ValueError(f"trajectory {traj.task_id!r}: {name}={shown} is invalid: {allowed}")

    for name in ("task_id", "env_backend"):
        if not isinstance(getattr(traj, name), str) or not getattr(traj, name):
            fail(name, getattr(traj, name), "a non-empty string")
    if traj.arm not in ARMS:
        fail("arm", traj.arm, f"one of {list(ARMS)}")
    if traj.status not in STATUSES:
        fail("status", traj.status, f"one of {list(STATUSES)}")
    if traj.reason is not None and not isinstance(traj.reason, str):
        fail("reason", traj.reason, "a string or null")
    if traj.status != "ok" and not (traj.reason or "").strip():
        fail("reason", traj.reason, f"a non-empty string when status is {traj.status!r}")
    if traj.reward is not None and not _is_finite(traj.reward):
        fail("reward", traj.reward, "a finite number or null")
    if traj.status == "ok" and traj.reward is None and traj.arm != "imported":
        fail("reward", None, "a number when status is 'ok' (only imported episodes may lack one)")
    for name, kind in _CONTAINERS:
        if not isinstance(getattr(traj, name), kind):
            fail(name, getattr(traj, name), f"a {kind.__name__}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in traj.setup_files.items()):
        fail("setup_files", traj.setup_files, "a mapping path -> text")
    for i, m in enumerate(traj.prompt):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            fail(f"prompt[{i}]", m, f"a message with role in {list(ROLES)}")
        if not isinstance(m.get("content"), str):
            fail(f"prompt[{i}].content", m.get("content"), "a string")
    if traj.source not in SOURCES:
        fail("source", traj.source, f"one of {list(SOURCES)}")
    if traj.arm == "imported" and traj.source != "rendered":
        fail("source", traj.source, "'rendered' for the imported arm (no sampler made its ids)")
    _validate_control(traj, fail)
    _validate_shaping(traj, fail)
    for i, turn in enumerate(traj.turns):
        _validate_turn(traj, turn, i, fail)
    _validate_trials(traj, fail)
    _validate_tokens(traj, fail)
    _validate_kv_epochs(traj, fail)
    _validate_context_resets(traj, fail)


def _validate_control(traj: Trajectory, fail) -> None:
    for name in ("group_index", "admitted_version"):
        value = getattr(traj, name)
        if value is not None and not (_is_int(value) and value >= 0):
            fail(name, value, "an integer >= 0 or null")
    for name in ("task_kind", "gate_unit", "replica_down"):
        value = getattr(traj, name)
        if value is not None and not (isinstance(value, str) and value):
            fail(name, value, "a non-empty string or null")
    if traj.trial_reward is not None and traj.trial_reward not in TRIAL_REWARDS:
        fail("trial_reward", traj.trial_reward, f"one of {list(TRIAL_REWARDS)} or null")
    if traj.replica_down is not None and traj.status != "aborted":
        fail(
            "replica_down",
            traj.replica_down,
            f"null when status is {traj.status!r} (a replica that went down aborts the episode)",
        )
    if traj.exclusion is not None and not isinstance(traj.exclusion, Exclusion):
        fail("exclusion", traj.exclusion, "an Exclusion(kind, reason) or null")
    control = sorted(set(traj.meta) & set(CONTROL_META_KEYS))
    if control:
        fail(
            f"meta[{control[0]!r}]",
            traj.meta[control[0]],
            "not in meta: control flags are "
            "typed fields (group_index, admitted_version, task_kind, trial_reward, gate_unit, "
            "replica_down, exclusion); meta is provenance only",
        )


def _validate_shaping(traj: Trajectory, fail) -> None:
    shaping, task = traj.shaping, traj.task_reward
    if not isinstance(shaping, dict):
        fail("shaping", shaping, "a mapping from term names to numbers")
    for name, value in shaping.items():
        if not (isinstance(name, str) and name):
            fail("shaping", name, "term names that are non-empty strings")
        if not _is_finite(value):
            fail(f"shaping[{name!r}]", value, "a finite number")
    if task is None:
        if shaping:
            fail("task_reward", None, "a number when shaping is set (shaping adds to it)")
        return
    if not _is_finite(task):
        fail("task_reward", task, "a finite number or null")
    if traj.reward != shaped_reward(task, shaping):
        fail(
            "reward",
            traj.reward,
            f"{shaped_reward(task, shaping)!r}: task_reward ({task!r}) plus the shaping terms",
        )


def _validate_kv_epochs(traj: Trajectory, fail) -> None:
    epochs = traj.kv_epochs
    if not isinstance(epochs, list):
        fail("kv_epochs", epochs, "a list")
    last = -1
    for e, epoch in enumerate(epochs):
        name = f"kv_epochs[{e}]"
        if not isinstance(epoch, dict) or set(epoch) != {"start", "kept"}:
            fail(name, epoch, 'an object {"start": int, "kept": [[a, b], ...]}')
        start, kept = epoch["start"], epoch["kept"]
        if e == 0 and start != 0:
            fail(f"{name}.start", start, "0 (the first epoch starts at the first token)")
        if not _is_int(start) or not last < start <= len(traj.token_ids):
            fail(
                f"{name}.start",
                start,
                f"an integer in ({last}, {len(traj.token_ids)}] "
                "(epochs in increasing order, within the token ids)",
            )
        last = start
        if not isinstance(kept, list):
            fail(f"{name}.kept", kept, "a list of [a, b] ranges")
        _check_ranges(kept, start, f"{name}.kept", fail)


def _check_ranges(ranges: list, start: int, name: str, fail) -> int:
    """`ranges` are sorted, disjoint `[a, b)` before `start`; returns where the last ends."""
    prev = 0
    for r in ranges:
        if not (
            isinstance(r, list | tuple)
            and len(r) == 2
            and all(_is_int(x) for x in r)
            and prev <= r[0] < r[1] <= start
        ):
            fail(name, r, f"sorted, disjoint [a, b) ranges with {prev} <= a < b <= start ({start})")
        prev = r[1]
    return prev


def _validate_context_resets(traj: Trajectory, fail) -> None:
    resets = traj.context_resets
    if not isinstance(resets, list):
        fail("context_resets", resets, "a list")
    last = 0
    for i, reset in enumerate(resets):
        name = f"context_resets[{i}]"
        if not isinstance(reset, dict) or set(reset) != {"start", "context"}:
            fail(name, reset, 'an object {"start": int, "context": [[a, b], ...]}')
        start, context = reset["start"], reset["context"]
        if not _is_int(start) or not last < start <= len(traj.token_ids):
            fail(
                f"{name}.start",
                start,
                f"an integer in ({last}, {len(traj.token_ids)}] "
                "(resets in increasing order, within the token ids)",
            )
        last = start
        if not isinstance(context, list) or not context:
            fail(f"{name}.context", context, "a non-empty list of [a, b] ranges")
        if _check_ranges(context, start, f"{name}.context", fail) != start:
            fail(f"{name}.context", context, f"ranges whose last one ends at start ({start})")
        prefix = [list(r) for r in context] == [[0, start]]
        nxt = resets[i + 1]["start"] if i + 1 < len(resets) else len(traj.token_ids) + 1
        inside = [e["start"] for e in traj.kv_epochs if start <= e["start"] < nxt]
        if inside and not prefix:
            fail(
                f"{name}.context",
                context,
                f"[[0, {start}]]: kv_epochs start inside this reset ({inside[0]}), and their "
                "positions are the reset's sequence's only when it re-sent the whole prefix",
            )


def _validate_trials(traj: Trajectory, fail) -> None:
    if not isinstance(traj.trials, list):
        fail("trials", traj.trials, "a list")
    end = 0
    for i, trial in enumerate(traj.trials):
        where = f"trials[{i}]"
        if not isinstance(trial, Trial):
            fail(where, trial, "a Trial")
        if trial.index != i:
            fail(f"{where}.index", trial.index, f"{i} (trials are listed in order)")
        if trial.start_turn != end:
            fail(f"{where}.start_turn", trial.start_turn, f"{end}: where the previous one ended")
        ok = _is_int(trial.end_turn) and end <= trial.end_turn <= len(traj.turns)
        if not ok:
            fail(f"{where}.end_turn", trial.end_turn, f"an int in [{end}, {len(traj.turns)}]")
        end = trial.end_turn
        if trial.reward is not None and not _is_finite(trial.reward):
            fail(f"{where}.reward", trial.reward, "a finite number or null")
        if trial.status not in STATUSES:
            fail(f"{where}.status", trial.status, f"one of {list(STATUSES)}")
        if trial.status != "ok" and not (isinstance(trial.reason, str) and trial.reason.strip()):
            fail(
                f"{where}.reason",
                trial.reason,
                f"a non-empty string when status is {trial.status!r}",
            )
        if not isinstance(trial.workspace_hash, str):
            fail(f"{where}.workspace_hash", trial.workspace_hash, "a string")
    if traj.trials and end != len(traj.turns):
        fail(
            "trials",
            f"<{len(traj.trials)} trials ending at turn {end}>",
            f"trials covering all {len(traj.turns)} turns",
        )


def _validate_turn(traj: Trajectory, turn: Turn, i: int, fail) -> None:
    where = f"turns[{i}]"
    if not isinstance(turn, Turn):
        fail(where, turn, "a Turn")
    if not isinstance(turn.agent_text, str):
        fail(f"{where}.agent_text", turn.agent_text, "a string")
    for name, kind in _TURN_CONTAINERS:
        if not isinstance(getattr(turn, name), kind):
            fail(f"{where}.{name}", getattr(turn, name), f"a {kind.__name__}")
    for name in ("command", "observation", "sim_observation"):
        value = getattr(turn, name)
        if value is not None and not isinstance(value, str):
            fail(f"{where}.{name}", value, "a string or null")
    for name in ("exit_code", "sim_exit_code"):
        value = getattr(turn, name)
        if value is not None and not _is_int(value):
            fail(f"{where}.{name}", value, "an integer or null")
    if traj.arm == "replay" and turn.observation is not None and turn.sim_observation is None:
        fail(f"{where}.sim_observation", None, "the simulated observation on the replay arm")
    for j, m in enumerate(turn.env_messages):
        if not isinstance(m, dict) or m.get("role") not in ENV_ROLES:
            fail(f"{where}.env_messages[{j}]", m, f"a message with role in {list(ENV_ROLES)}")
        if not isinstance(m.get("content"), str):
            fail(f"{where}.env_messages[{j}].content", m.get("content"), "a string")
    for key, value in turn.timings.items():
        if not (_is_finite(value) and value >= 0):
            fail(f"{where}.timings[{key!r}]", value, "a finite number of seconds >= 0")
    for j, flag in enumerate(turn.flags):
        if not isinstance(flag, str) or not flag:
            fail(f"{where}.flags[{j}]", flag, "a non-empty string")


def _validate_tokens(traj: Trajectory, fail) -> None:
    ids, mask, n = traj.token_ids, traj.loss_mask, len(traj.token_ids)
    j = next((j for j, t in enumerate(ids) if not (_is_int(t) and t >= 0)), None)
    if j is not None:
        fail(f"token_ids[{j}]", ids[j], "a token id >= 0")
    if len(mask) != n:
        fail("loss_mask", f"<{len(mask)} values>", f"{n} values, aligned with token_ids")
    j = next((j for j, m in enumerate(mask) if not (_is_int(m) and m in (0, 1))), None)
    if j is not None:
        fail(f"loss_mask[{j}]", mask[j], "0 or 1")
    # loss_mask is 1 exactly on the turns' spans: the tokens the agent generated.
    expected = [0] * n
    prev_end = 0
    for i, turn in enumerate(traj.turns):
        span = turn.token_span
        if n == 0:
            if span is not None:
                fail(f"turns[{i}].token_span", span, "null when there is no token view")
            continue
        ok = span is not None and all(_is_int(x) for x in span)
        if not ok or not prev_end <= span[0] < span[1] <= n:
            fail(
                f"turns[{i}].token_span",
                span,
                f"[start, end) with {prev_end} <= start < end <= {n}",
            )
        expected[span[0] : span[1]] = [1] * (span[1] - span[0])
        prev_end = span[1]
    if list(mask) != expected:
        j = next(k for k in range(n) if mask[k] != expected[k])
        fail(f"loss_mask[{j}]", mask[j], f"{expected[j]}: 1 only on the turns' generated tokens")
    if traj.source == "rendered":
        for name in ("behavior_logprobs", "policy_version"):
            if getattr(traj, name) is not None:
                fail(name, "<list>", "null when source is 'rendered' (no sampler produced the ids)")
        return
    logp, version = traj.behavior_logprobs, traj.policy_version
    for name, values in (("behavior_logprobs", logp), ("policy_version", version)):
        if not isinstance(values, list) or len(values) != n:
            shown = values if values is None else f"<{len(values)} values>"
            fail(name, shown, f"{n} values aligned with token_ids (source is 'sampler')")
    last = -1
    for j in range(n):
        if mask[j]:
            if not _is_finite(logp[j]):
                fail(f"behavior_logprobs[{j}]", logp[j], "a finite float where loss_mask is 1")
            if not _is_int(version[j]) or version[j] < 0:
                fail(f"policy_version[{j}]", version[j], "an int >= 0 where loss_mask is 1")
            if version[j] < last:
                fail(f"policy_version[{j}]", version[j], f">= {last}: versions never decrease")
            last = version[j]
        else:
            if logp[j] is not None:
                fail(f"behavior_logprobs[{j}]", logp[j], "null where loss_mask is 0")
            if version[j] is not None:
                fail(f"policy_version[{j}]", version[j], "null where loss_mask is 0")


def render_token_view(
    traj: Trajectory, renderer: ChatRenderer, *, enable_thinking: bool = False
) -> None:
    """Fill the token view of a text-only trajectory (`source="rendered"`) append-only: the
    prompt with the generation prompt, then per turn the agent's text + `<|im_end|>` (loss 1,
    encoded on its own as a sampler would emit it) and the env messages (loss 0)."""
    tok = renderer.tokenizer
    ids = renderer.render(traj.prompt, add_generation_prompt=True, enable_thinking=enable_thinking)
    mask = [0] * len(ids)
    for n, turn in enumerate(traj.turns):
        generated = tok.encode(turn.agent_text) + [renderer.im_end_id]
        turn.token_span = (len(ids), len(ids) + len(generated))
        ids += generated
        mask += [1] * len(generated)
        for k, message in enumerate(turn.env_messages):
            more = renderer.append(
                ids,
                message,
                add_generation_prompt=k == len(turn.env_messages) - 1,
                enable_thinking=enable_thinking,
            )
            ids += more
            mask += [0] * len(more)
        if not turn.env_messages and n + 1 < len(traj.turns):  # two replies in a row
            more = renderer.newline_ids + tok.encode(generation_prompt(enable_thinking))
            ids += more
            mask += [0] * len(more)
    traj.token_ids, traj.loss_mask = ids, mask
    traj.source, traj.behavior_logprobs, traj.policy_version = "rendered", None, None


_SCALARS = (int, float, str, bool, type(None))


def plain(obj: Any) -> Any:
    """`dataclasses.asdict` for what trajectories hold, ~10x faster on their long id lists:
    a list of scalars is copied in one step instead of element by element (the orchestrator
    serialises every episode on its event loop). Dataclasses become dicts, lists, tuples and
    dicts new containers, anything else a deep copy, as `asdict` makes them."""
    kind = type(obj)
    if kind in _SCALARS:
        return obj
    if kind is list or kind is tuple:
        if all(type(x) in _SCALARS for x in obj):
            return kind(obj)
        return kind(plain(x) for x in obj)
    if kind is dict:
        return {plain(k): plain(v) for k, v in obj.items()}
    if hasattr(kind, "__dataclass_fields__"):
        return {f.name: plain(getattr(obj, f.name)) for f in fields(obj)}
    return copy.deepcopy(obj)


def to_json_line(traj: Trajectory) -> str:
    validate(traj)
    return json.dumps(traj.to_dict(), ensure_ascii=False, allow_nan=False)


def write_jsonl(path: str | os.PathLike, trajectories: Iterable[Trajectory]) -> Path:
    """Validate and write one JSONL shard atomically (temp file in the same folder, fsync,
    rename): a reader never sees a half-written shard, a crash leaves the old one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for i, traj in enumerate(trajectories):
                try:
                    f.write(to_json_line(traj) + "\n")
                except ValueError as e:
                    raise ValueError(f"{path}: trajectory #{i}: {e}") from e
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def iter_jsonl(path: str | os.PathLike, *, check: bool = True) -> Iterator[Trajectory]:
    """Trajectories of one shard; errors name the file and line. A last line without its
    newline that does not parse is what a writer killed mid-append leaves (every record is
    written whole, newline included): it is skipped with a warning, not an error."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                data = json.loads(raw.decode("utf-8"))
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError (a cut character)
                if not raw.endswith(b"\n"):
                    log.warning(
                        "%s:%d: skipped a torn last record (%d bytes): its writer was "
                        "killed mid-write",
                        path,
                        lineno,
                        len(raw),
                    )
                    return
                raise ValueError(f"{path}:{lineno}: {e}") from e
            try:
                yield Trajectory.from_dict(data, check=check)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from e


def read_jsonl(path: str | os.PathLike, *, check: bool = True) -> list[Trajectory]:
    return list(iter_jsonl(path, check=check))


def load_trajectories(paths: Iterable[str | os.PathLike]) -> list[Trajectory]:
    """Trajectories from JSONL files and folders (every `*.jsonl` below, in sorted order)."""
    out: list[Trajectory] = []
    for p in map(Path, paths):
        files = sorted(p.rglob("*.jsonl")) if p.is_dir() else [p]
        for file in files:
            out.extend(iter_jsonl(file))
    return out


def canonical_order(trajectories: Iterable[Trajectory]) -> list[Trajectory]:
    """The trajectories in an order that does not depend on when each episode finished:
    by task, group and index in the group, then by content. Writers append episodes as they
    complete, so two runs of one collection hold the same episodes in different orders; a
    trainer that reads them in this order sees the same data stream in every run."""

    def key(t: Trajectory) -> tuple:
        index = t.group_index if t.group_index is not None else -1
        return (t.task_id, t.group_id, index, to_json_line(t))

    return sorted(trajectories, key=key)
