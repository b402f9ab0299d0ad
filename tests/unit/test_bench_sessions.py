"""bench/sessions.py --quick end to end: real `simloop serve` processes, sessions against the
stateless peer (prefix reuse on) and true re-prefill, the KV each compaction mode holds, rows
in the common JSON shape."""

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROW_KEYS = {"measure", "ours", "peer", "ratio", "ratio_of", "target", "unit"}
PEERS = ("vs stateless + prefix reuse", "vs re-prefill")


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "sessions.json"
    done = subprocess.run(
        [sys.executable, "bench/sessions.py", "--quick", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_quick_run_writes_rows_against_both_peers(quick):
    assert quick["bench"] == "sessions"
    rows = quick["rows"]
    assert all(set(r) == ROW_KEYS and isinstance(r["ours"], int | float) for r in rows)
    for vs in PEERS:
        mine = [r for r in rows if r["measure"].endswith(vs)]
        assert [(m["measure"].split(" (")[0].split(",")[0], m["unit"]) for m in mine] == [
            ("per-turn latency", "ms"),
            ("per-turn latency", "ms"),
            (f"latency drift without compaction: last turns / turns 2-8 {vs}", "x"),
            ("latency added by sessions", "ms"),
            ("tokens prefilled", "tokens"),
            ("tokens prefilled beyond those appended", "tokens"),
            ("wall time", "s"),
        ]
        added = mine[3]
        assert added["ratio_of"] == "ours/peer" and added["target"] == "ratio <= 1.2"
        assert added["ratio"] == added["ours"] / added["peer"]
        assert all(m["peer"] > 0 for m in mine)
        assert all(m["ratio_of"] == "peer/ours" for m in mine if m is not added)
    by = {r["measure"]: r for r in rows}
    # Without compaction the KV grows every turn, and so does attention over it: no target.
    drift = by[f"latency drift without compaction: last turns / turns 2-8 {PEERS[0]}"]
    assert drift["target"] is None and drift["ours"] > 0
    # markovian holds the same KV from turn 2 on: its latency must stay flat.
    flat = by["latency drift: markovian vs none"]
    assert flat["target"] == "<= 1.2" and flat["peer"] == drift["ours"]
    assert by["latency drift: budget vs none"]["target"] is None
    d = quick["detail"]
    assert (d["episodes"], d["turns"], d["obs_tokens"], d["reply_tokens"]) == (2, 8, 64, 8)
    for mode in ("session", "stateless", "reprefill"):
        assert d[mode]["drift_by_run"] == [d[mode]["drift"]]  # --quick: one round
        assert len(d[mode]["turn_ms"]) == len(d[mode]["turn_prefilled"]) == 8
        assert all(ms > 0 for ms in d[mode]["turn_ms"])


def test_sessions_prefill_only_what_each_turn_appends_and_less_than_re_prefill(quick):
    d = quick["detail"]
    ours, reprefill = d["session"], d["reprefill"]
    appended = 2 * 8 * 64
    # Each turn after the first also prefills the previous reply's last token (sampled, not
    # yet in the KV); nothing more.
    assert ours["appended"] == appended
    assert ours["prefilled"] == appended + 2 * 7 and ours["max_extra_prefill"] == 1
    assert ours["turn_prefilled"] == [2 * 64] + [2 * 65] * 7
    # Re-prefill (no reuse) prefills every token it sends: the whole history each turn.
    assert reprefill["prefilled"] == reprefill["sent"] == ours["sent"]
    assert reprefill["prefilled"] > 4 * ours["prefilled"]
    assert reprefill["turn_prefilled"] == sorted(reprefill["turn_prefilled"])
    # The stateless peer on the sessions' server reuses a finished slot's KV where it can.
    assert ours["prefilled"] <= d["stateless"]["prefilled"] < reprefill["prefilled"]
    by = {r["measure"]: r for r in quick["rows"]}
    row = by[f"tokens prefilled, whole run (2 x 8 turns) {PEERS[1]}"]
    assert (row["ours"], row["peer"]) == (ours["prefilled"], reprefill["prefilled"])
    assert row["ratio"] > 4


def test_each_compaction_mode_holds_less_kv_than_none(quick):
    d = quick["detail"]
    full = d["session"]["kv_last"]
    assert full == 8 * (64 + 8) - 1  # every appended and generated token but the last
    # markovian: the prompt (turn 1's observation) and the last turn only
    assert d["session:markovian"]["kv_last"] == 64 + 8 + 64 + 7
    # ... from the second turn on, so its turns all hold the same KV (what keeps them flat)
    assert d["session:markovian"]["turn_kv"][1:] == [64 + 8 + 64 + 7] * 7
    assert d["session"]["turn_kv"] == [72 * t - 1 for t in range(1, 9)]
    # turn: older turns thinned to half; budget: never more than a quarter of the episode
    assert full / 2 < d["session:turn"]["kv_last"] < full
    assert d["session:budget"]["kv_max"] <= 8 * 72 // 4
    by = {r["measure"]: r for r in quick["rows"]}
    for mode in ("markovian", "turn", "budget"):
        row = by[f"KV held at the last turn: {mode} vs none"]
        assert row["peer"] == full and row["ratio"] > 1


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # sessions.py imports bench/results.py
    spec = importlib.util.spec_from_file_location("bench_sessions", REPO / "bench" / "sessions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rounds_pool_turn_by_turn_and_keep_the_worst_extra_prefill(bench):
    one = {
        "wall_s": 10.0,
        "early_ms": 100.0,
        "late_ms": 150.0,
        "drift": 1.5,
        "prefilled": 7,
        "max_extra_prefill": 1,
        "turn_ms": [50.0, 100.0],
        "replies": [[1, 2]],
    }
    two = one | {
        "wall_s": 20.0,
        "early_ms": 300.0,
        "late_ms": 250.0,
        "drift": 250 / 300,
        "max_extra_prefill": 2,
        "turn_ms": [150.0, 300.0],
    }
    got = bench.pooled([one, two])
    # (150 + 250) / 2 over (100 + 300) / 2: a ratio of the pooled means, not a mean of ratios
    assert got["drift"] == 200.0 / 200.0 and got["drift_by_run"] == [1.5, 250 / 300]
    assert (got["early_ms"], got["late_ms"], got["wall_s"]) == (200.0, 200.0, 15.0)
    assert got["turn_ms"] == [100.0, 200.0] and got["max_extra_prefill"] == 2
    assert got["prefilled"] == 7 and got["replies_same_every_run"]
    assert not bench.pooled([one, one | {"replies": [[1, 3]]}])["replies_same_every_run"]


def test_drift_once_full_starts_at_the_first_turn_within_a_turn_of_the_most_kv(bench):
    args = argparse.Namespace(obs_tokens=8, reply_tokens=2)  # a turn adds 10 positions
    # KV fills for 4 turns (the fourth, 31, within a turn of the most, 40), then stays at 35-40
    kv = [9, 19, 29, 31] + [35, 40] * 12
    ms = [10.0, 20.0, 30.0, 40.0] + [50.0] * 10 + [60.0] * 4 + [75.0] * 10
    # the first window starts at the fourth turn: 40 and nine turns of 50
    assert bench.drift_once_full({"turn_kv": kv, "turn_ms": ms}, args) == 75.0 / 49.0
    # a KV that grows to the end is never full
    grows = {"turn_kv": list(range(10, 290, 10)), "turn_ms": ms}
    assert bench.drift_once_full(grows, args) is None
    # full from the first turn: counted from turn 2 (turn 1 has no history)
    flat = {"turn_kv": [40] * 28, "turn_ms": [99.0] + [50.0] * 17 + [60.0] * 10}
    assert bench.drift_once_full(flat, args) == 60.0 / 50.0
