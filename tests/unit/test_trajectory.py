"""The trajectory schema: one test per invariant the validator enforces, JSON and JSONL round
trips (atomic writes), the typed control fields (and schema 1 files, which kept them in `meta`),
and append-only rendering of a text-only token view."""

import copy
import dataclasses
import json
import math

import pytest

from rl.data import ByteTokenizer, ChatRenderer, render_text
from rl.data.trajectory import (
    SCHEMA_VERSION,
    Exclusion,
    Trajectory,
    Trial,
    Turn,
    read_jsonl,
    render_token_view,
    validate,
    write_jsonl,
)

RENDERER = ChatRenderer(ByteTokenizer())
PROMPT = [
    {"role": "system", "content": "You are a terminal agent."},
    {"role": "user", "content": "Reverse 'abc'."},
]
REPLIES = ["```bash\necho abc | rev\n```", "```bash\nsubmit cba\n```"]


def sampled(arm: str = "real") -> Trajectory:
    """A valid two-turn trajectory built the way the orchestrator builds one: prompt ids, then
    per turn the generated ids (version 3, then 4) and the appended observation."""
    tok = RENDERER.tokenizer
    ids = RENDERER.render(PROMPT, add_generation_prompt=True)
    logp, version = [None] * len(ids), [None] * len(ids)
    turns = []
    for n, reply in enumerate(REPLIES):
        gen = tok.encode(reply) + [RENDERER.im_end_id]
        span = (len(ids), len(ids) + len(gen))
        ids += gen
        logp += [-0.5] * len(gen)
        version += [3 + n] * len(gen)
        env = [{"role": "tool", "content": "cba"}] if n == 0 else []
        for m in env:
            more = RENDERER.append(ids, m, add_generation_prompt=True)
            ids += more
            logp += [None] * len(more)
            version += [None] * len(more)
        turns.append(
            Turn(
                agent_text=reply,
                command="echo abc | rev" if n == 0 else "submit cba",
                observation="cba" if n == 0 else None,
                exit_code=0 if n == 0 else None,
                env_messages=env,
                sim_observation="cba" if arm == "replay" and n == 0 else None,
                timings={"agent_s": 0.1, "env_s": 0.02},
                token_span=span,
            )
        )
    mask = [0 if v is None else 1 for v in version]
    return Trajectory(
        task_id="textops-0",
        arm=arm,
        env_backend="local",
        status="ok",
        reward=1.0,
        group_id="g0",
        instruction="Reverse 'abc'.",
        prompt=PROMPT,
        turns=turns,
        token_ids=ids,
        loss_mask=mask,
        behavior_logprobs=logp,
        policy_version=version,
        tokenizer="byte",
    )


def first_gen(traj: Trajectory) -> int:
    return traj.turns[0].token_span[0]


def test_valid_trajectories_pass():
    validate(sampled())
    validate(sampled("replay"))


def _set(name, value):
    def mutate(t):
        setattr(t, name, value)

    return mutate


def _item(name, index, value):
    def mutate(t):
        values = getattr(t, name)
        values[index(t) if callable(index) else index] = value

    return mutate


def _turn(i, name, value):
    def mutate(t):
        setattr(t.turns[i], name, value)

    return mutate


BROKEN = {
    # token arrays aligned
    "mask_short": (lambda t: t.loss_mask.pop(), "loss_mask="),
    "logprobs_short": (lambda t: t.behavior_logprobs.pop(), "behavior_logprobs="),
    "versions_short": (lambda t: t.policy_version.pop(), "policy_version="),
    "negative_id": (_item("token_ids", 0, -1), "token_ids[0]"),
    # loss_mask is 1 only on generated tokens (and on all of them)
    "mask_on_prompt": (_item("loss_mask", 0, 1), "loss_mask[0]"),
    "mask_off_generated": (_item("loss_mask", first_gen, 0), "loss_mask["),
    "mask_not_binary": (_item("loss_mask", 0, 2), "loss_mask[0]"),
    "span_out_of_range": (_turn(1, "token_span", (10, 10_000)), "turns[1].token_span"),
    "spans_out_of_order": (lambda t: t.turns.reverse(), "token_span"),
    "span_missing": (_turn(0, "token_span", None), "turns[0].token_span"),
    # behavior logprobs finite exactly where loss_mask is 1
    "logprob_missing": (_item("behavior_logprobs", first_gen, None), "behavior_logprobs["),
    "logprob_nan": (_item("behavior_logprobs", first_gen, math.nan), "behavior_logprobs["),
    "logprob_inf": (_item("behavior_logprobs", first_gen, -math.inf), "behavior_logprobs["),
    "logprob_on_prompt": (_item("behavior_logprobs", 0, -1.0), "behavior_logprobs[0]"),
    "logprobs_absent": (_set("behavior_logprobs", None), "behavior_logprobs=None"),
    # policy versions present where loss_mask is 1 and never decreasing
    "version_missing": (_item("policy_version", first_gen, None), "policy_version["),
    "version_on_prompt": (_item("policy_version", 0, 3), "policy_version[0]"),
    "version_decreases": (_item("policy_version", -1, 2), "never decrease"),
    # status, reason, reward
    "bad_status": (_set("status", "done"), "status="),
    "no_reason": (_set("status", "truncated"), "reason=None"),
    "ok_without_reward": (_set("reward", None), "reward=None"),
    "nan_reward": (_set("reward", math.nan), "reward=nan"),
    "bad_arm": (_set("arm", "sim"), "arm="),
    "empty_task_id": (_set("task_id", ""), "task_id="),
    # text-only mode must be explicit
    "rendered_with_logprobs": (_set("source", "rendered"), "behavior_logprobs="),
    "imported_from_sampler": (_set("arm", "imported"), "source="),
    # turns
    "negative_timing": (_turn(0, "timings", {"env_s": -1.0}), "turns[0].timings['env_s']"),
    "bad_env_role": (_turn(0, "env_messages", [{"role": "assistant", "content": "x"}]), "env_m"),
    "exit_code_text": (_turn(0, "exit_code", "0"), "turns[0].exit_code"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_validator_catches_each_broken_invariant(case):
    mutate, field_name = BROKEN[case]
    traj = sampled()
    mutate(traj)
    with pytest.raises(ValueError, match="is invalid") as err:
        validate(traj)
    assert field_name in str(err.value), str(err.value)


def test_replay_arm_needs_the_simulated_observation():
    traj = sampled("replay")
    traj.turns[0].sim_observation = None
    with pytest.raises(ValueError, match=r"turns\[0\]\.sim_observation"):
        validate(traj)


def test_text_only_mode_is_explicit_and_valid():
    traj = sampled()
    traj.source, traj.behavior_logprobs, traj.policy_version = "rendered", None, None
    validate(traj)  # e.g. a scripted agent in a real shell: SFT data, never RL data
    traj.arm, traj.reward = "imported", None
    validate(traj)  # an imported episode may end ok without a recorded score
    traj.arm = "real"
    with pytest.raises(ValueError, match="reward=None"):
        validate(traj)


def test_json_round_trip_uses_null_never_nan():
    traj = sampled()
    line = json.dumps(traj.to_dict(), allow_nan=False)
    assert "NaN" not in line and '"behavior_logprobs": [null' in line
    again = Trajectory.from_dict(json.loads(line))
    assert again == traj
    assert again.turns[0].token_span == traj.turns[0].token_span


def test_to_dict_is_asdict_and_shares_nothing_with_the_trajectory():
    """The fast converter gives what `dataclasses.asdict` gives (with a trial, nested meta and
    info), and a caller that edits the dict leaves the trajectory as it was."""
    traj = sampled()
    traj.trials = [Trial(index=0, start_turn=0, end_turn=1, reward=1.0)]
    traj.meta = {"env_status": "ok", "nested": {"a": [1, {"b": (2, 3)}]}}
    traj.turns[0].info = {"finish_reason": "stop", "trial_end": 0}
    expected = dataclasses.asdict(traj)
    for turn in expected["turns"]:
        turn["token_span"] = list(turn["token_span"])
    data = traj.to_dict()
    assert data == {"schema": SCHEMA_VERSION, **expected}
    before = copy.deepcopy(traj)
    data["token_ids"].append(7)
    data["turns"][0]["timings"]["agent_s"] = 9.0
    data["meta"]["nested"]["a"][1]["b"] = None
    data["prompt"][0]["content"] = "changed"
    assert traj == before


def test_from_dict_names_unknown_missing_and_schema():
    data = sampled().to_dict()
    with pytest.raises(ValueError, match="unknown key.*'rewrd'"):
        Trajectory.from_dict({**data, "rewrd": 1.0})
    with pytest.raises(ValueError, match="missing key.*'status'"):
        Trajectory.from_dict({k: v for k, v in data.items() if k != "status"})
    bad_turn = copy.deepcopy(data)
    bad_turn["turns"][1]["cmd"] = "ls"
    with pytest.raises(ValueError, match=r"turns\[1\]: unknown key.*'cmd'"):
        Trajectory.from_dict(bad_turn)
    with pytest.raises(ValueError, match="schema=3 is invalid: this simloop reads 1 and 2"):
        Trajectory.from_dict({**data, "schema": 3})


# ----- typed control fields ------------------------------------------------------------------

# A line as simloop wrote it before the control flags were typed (schema 1, generated by the
# code at 8ef5396): a failed episode of a masked group, every flag a `meta` key.
SCHEMA_1_LINE = (
    '{"schema": 1, "task_id": "textops-3", "arm": "real", "env_backend": "local", "status": '
    '"error", "reason": "agent request failed: 503", "reward": null, "group_id": "g1-textops-3", '
    '"instruction": "Reverse abc.", "setup_files": {}, "prompt": [], "turns": [], "source": '
    '"sampler", "token_ids": [], "loss_mask": [], "behavior_logprobs": [], "policy_version": [], '
    '"tokenizer": "ByteTokenizer", "meta": {"group_index": 1, "admitted_version": 2, '
    '"task_kind": "reverse", "env_status": "error", "masked": true, "masked_reason": '
    '"2 sibling(s) failed: agent request failed: 503", "gate_unit": "reverse", "trial_reward": '
    '"per_trial"}, "trials": [], "kv_epochs": [], "rollout_id": ""}'
)


def test_a_schema_1_line_loads_its_meta_flags_onto_the_typed_fields(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text(SCHEMA_1_LINE + "\n")
    (t,) = read_jsonl(path)
    assert (t.group_index, t.admitted_version, t.task_kind) == (1, 2, "reverse")
    assert (t.gate_unit, t.trial_reward, t.replica_down) == ("reverse", "per_trial", None)
    assert t.exclusion == Exclusion(
        "masked_group", "2 sibling(s) failed: agent request failed: 503"
    )
    assert t.meta == {"env_status": "error"}  # provenance stays
    again = Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))  # written as schema 2
    assert again == t and again.to_dict()["schema"] == SCHEMA_VERSION == 2


@pytest.mark.parametrize(
    ("meta", "status", "want"),
    [
        ({"dropped": True}, "error", {"exclusion": ("dropped", "drop_episode): agent failed")}),
        ({"dropped": "the server forgot the agent's compacted session mid-episode; ..."}, "ok",
         {"exclusion": ("unreplayable", "the server forgot")}),
        ({"dropped": "reward_mode last_segment: only the last segment trains", "segment": 0},
         "ok", {"exclusion": ("earlier_segment", "last_segment"), "meta": {"segment": 0}}),
        ({"dropped": "a harness's own words"}, "ok", {"exclusion": ("dropped", "own words")}),
        ({"stale": 3}, "ok", {"exclusion": ("stale", "admitted 3 versions")}),
        ({"masked": True, "dropped": True}, "error", {"exclusion": ("masked_group", "sibling")}),
        ({"replica_down": "http://10.0.0.7:8000"}, "aborted",
         {"replica_down": "http://10.0.0.7:8000"}),
        ({"kind": "count"}, "ok", {"task_kind": "count"}),  # simloop pretrain-sim
        ({"shadow": True, "sim_version": 1, "unit": "textops", "admitted_version": 4}, "ok",
         {"gate_unit": "textops", "admitted_version": 4,
          "meta": {"shadow": True, "sim_version": 1}}),
        ({"harness": "command", "kind": "x", "task_kind": "upper"}, "ok",
         {"task_kind": "upper", "meta": {"harness": "command", "kind": "x"}}),
    ],
)  # fmt: skip
def test_schema_1_meta_flags_map_onto_fields(meta, status, want):
    reason = None if status == "ok" else "agent failed"
    data = {
        "schema": 1,
        "task_id": "t",
        "arm": "real",
        "env_backend": "local",
        "status": status,
        "reason": reason,
        "reward": 1.0,
        "meta": meta,
    }
    t = Trajectory.from_dict(data)
    want = dict(want)
    kind_and_words = want.pop("exclusion", None)
    if kind_and_words is None:
        assert t.exclusion is None
    else:
        assert t.exclusion.kind == kind_and_words[0] and kind_and_words[1] in t.exclusion.reason
    assert t.meta == want.pop("meta", {})
    for name, value in want.items():
        assert getattr(t, name) == value, name


def test_typed_fields_round_trip_through_json_and_jsonl(tmp_path):
    traj = sampled()
    traj.group_index, traj.admitted_version, traj.task_kind = 3, 7, "reverse"
    traj.trial_reward, traj.gate_unit = "first_success", "textops"
    traj.exclusion = Exclusion("unreplayable", "the server recomputed the session")
    traj.meta = {"env_status": "submitted"}
    line = json.loads(json.dumps(traj.to_dict()))
    assert line["exclusion"] == {
        "kind": "unreplayable",
        "reason": "the server recomputed the session",
    }
    assert (line["group_index"], line["admitted_version"], line["task_kind"]) == (3, 7, "reverse")
    assert line["meta"] == {"env_status": "submitted"}  # provenance only
    assert Trajectory.from_dict(line) == traj
    assert traj.meta == {"env_status": "submitted"}  # writing left the trajectory alone
    aborted = sampled()
    aborted.status, aborted.reason, aborted.replica_down = "aborted", "replica down", "http://r:1"
    write_jsonl(tmp_path / "s.jsonl", [traj, aborted])
    assert read_jsonl(tmp_path / "s.jsonl") == [traj, aborted]
    # A schema 2 record naming a control field in meta means two things: refused.
    with pytest.raises(ValueError, match=r"meta\['group_index'\]=4 is invalid"):
        Trajectory.from_dict({**line, "meta": {"group_index": 4}})


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("group_index", -1, r"group_index=-1 is invalid: an integer >= 0 or null"),
        ("group_index", "1", r"group_index='1' is invalid: an integer >= 0 or null"),
        ("admitted_version", True, r"admitted_version=True is invalid: an integer >= 0"),
        ("task_kind", "", r"task_kind='' is invalid: a non-empty string or null"),
        ("gate_unit", 3, r"gate_unit=3 is invalid: a non-empty string or null"),
        ("trial_reward", "best", r"trial_reward='best' is invalid: one of \['first_success', "
         r"'per_trial'\] or null"),
        ("replica_down", "http://r:1", r"replica_down='http://r:1' is invalid: null when "
         r"status is 'ok'"),
        ("exclusion", "dropped", r"exclusion='dropped' is invalid: an Exclusion\(kind, reason\)"),
        ("meta", {"dropped": True}, r"meta\['dropped'\]=True is invalid: not in meta: control "
         r"flags are typed fields"),
        ("meta", {"group_index": 0}, r"meta\['group_index'\]=0 is invalid"),
    ],
)  # fmt: skip
def test_bad_control_fields_are_named_with_what_is_allowed(field, value, message):
    traj = sampled()
    setattr(traj, field, value)
    with pytest.raises(ValueError, match=message):
        validate(traj)


def test_an_exclusion_checks_its_kind_and_reason():
    with pytest.raises(ValueError, match=r"exclusion.kind='gone' is invalid: one of \['masked_"):
        Exclusion("gone", "why")
    with pytest.raises(ValueError, match=r"exclusion.reason=' ' is invalid: a non-empty string"):
        Exclusion("stale", " ")
    data = sampled().to_dict()
    with pytest.raises(ValueError, match=r"exclusion: unknown key\(s\) \['why'\]"):
        Trajectory.from_dict({**data, "exclusion": {"kind": "stale", "why": "x"}})
    with pytest.raises(ValueError, match=r"exclusion.kind='late' is invalid"):
        Trajectory.from_dict({**data, "exclusion": {"kind": "late", "reason": "x"}})


def test_jsonl_round_trip_and_atomic_write(tmp_path):
    trajs = [sampled(), sampled("replay")]
    trajs[1].status, trajs[1].reason, trajs[1].reward = "timeout", "command hung", None
    path = write_jsonl(tmp_path / "shard.jsonl", trajs)
    assert read_jsonl(path) == trajs
    assert [p.name for p in tmp_path.iterdir()] == ["shard.jsonl"]  # no temp file left

    broken = sampled()
    broken.loss_mask[0] = 1
    with pytest.raises(ValueError, match=r"trajectory #1: .*loss_mask\[0\]"):
        write_jsonl(path, [sampled(), broken])
    assert read_jsonl(path) == trajs  # the old shard is intact
    assert [p.name for p in tmp_path.iterdir()] == ["shard.jsonl"]


def test_read_jsonl_names_file_and_line(tmp_path):
    good = json.dumps(sampled().to_dict())
    bad = sampled().to_dict()
    bad["policy_version"][-1] = 0
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: .*policy_version"):
        read_jsonl(path)


@pytest.mark.parametrize("replies_in_a_row", [False, True])
def test_rendered_token_view_is_append_only_render(replies_in_a_row):
    traj = sampled()
    if replies_in_a_row:  # a transcript where the env said nothing between two replies
        traj.turns[0].env_messages = []
    traj.token_ids, traj.loss_mask = [], []
    for turn in traj.turns:
        turn.token_span = None
    render_token_view(traj, RENDERER, enable_thinking=False)
    validate(traj)
    assert traj.source == "rendered" and traj.behavior_logprobs is None
    messages = list(PROMPT)
    for turn in traj.turns:
        messages.append({"role": "assistant", "content": turn.agent_text, "reasoning_content": ""})
        messages.extend(turn.env_messages)
    text = RENDERER.tokenizer.decode(traj.token_ids)
    # The last reply ends at the generated <|im_end|>; the full render adds the newline.
    assert text + "\n" == render_text(messages, enable_thinking=False)
    for turn in traj.turns:
        start, end = turn.token_span
        assert RENDERER.tokenizer.decode(traj.token_ids[start:end]) == turn.agent_text + (
            "<|im_end|>"
        )


def test_canonical_order_ignores_completion_order():
    """Episodes written in completion order come back in one order whatever that was: by task,
    group, index in the group, then content (two episodes alike in all of those but their
    observations still get a fixed order)."""
    import random

    from rl.data.trajectory import canonical_order

    trajs = []
    for task in ("t-2", "t-10", "t-1"):
        for index in (1, 0):
            for obs in ("b", "a"):
                t = copy.deepcopy(sampled())
                t.task_id, t.group_id = task, f"g-{task}"
                t.group_index = index
                t.turns[0].observation = obs
                trajs.append(t)
    want = [(t.task_id, t.group_index, t.turns[0].observation) for t in canonical_order(trajs)]
    assert want[:4] == [("t-1", 0, "a"), ("t-1", 0, "b"), ("t-1", 1, "a"), ("t-1", 1, "b")]
    rng = random.Random(0)
    for _ in range(5):
        shuffled = trajs[:]
        rng.shuffle(shuffled)
        got = [
            (t.task_id, t.group_index, t.turns[0].observation) for t in canonical_order(shuffled)
        ]
        assert got == want
