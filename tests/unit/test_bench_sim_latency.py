"""bench/sim_latency.py against a given URL: the bench script, as a user runs it, drives a
tiny in-process `simloop serve` (`background_server`) with requests built from a small
history file written here (no ../shared/data needed), and its table, its JSON rows and the
server's own counters agree; and the histories it collects itself are real shell output."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import sys
from asyncio.subprocess import PIPE
from pathlib import Path

import pytest
import pytest_asyncio
from flax import nnx

from rl.data import ByteTokenizer
from rl.data.importers_common import imported
from rl.data.trajectory import Turn, write_jsonl
from rl.model import Qwen3, tiny
from serving.config import ServerConfig
from serving.engine import Engine, EngineConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")
REPO = Path(__file__).resolve().parents[2]
ROW_KEYS = {"measure", "ours", "peer", "ratio", "ratio_of", "target", "unit"}
TOK = ByteTokenizer()
CONTEXT, MAX_TOKENS, CONC = 1024, 4, 2
DEPTHS = (1, 3, 9)


def turns(observations: list[str]) -> list[Turn]:
    return [
        Turn(agent_text=f"```bash\necho {i}\n```", command=f"echo {i}", observation=o, exit_code=0)
        for i, o in enumerate(observations)
    ]


def histories(path: Path) -> Path:
    """Three episodes: `short` (5 turns of short output); `long_first` (4 turns, the first
    printing 2,000 characters: no prompt of this context holds it, so it is the turn
    dropped); and a simulated-shell episode of 12 turns that the bench must leave out (only
    real observations count), or depth 9 would not be empty."""
    trajectories = [
        imported("short", "local", status="ok", instruction="t", turns=turns(["a"] * 5)),
        imported(
            "long_first",
            "local",
            status="ok",
            instruction="t",
            turns=turns(["x" * 2000] + ["b"] * 3),
        ),
        imported("sim", "simulated", status="ok", instruction="t", turns=turns(["c"] * 12)),
    ]
    return write_jsonl(path, trajectories)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run(tmp_path_factory) -> dict:
    """The bench as a subprocess against one in-process server: its JSON, its stdout and the
    engine's counters before and after."""
    from serving.server import background_server

    tmp = tmp_path_factory.mktemp("bench")
    out, hist = tmp / "sim_latency.json", histories(tmp / "histories.jsonl")
    model = Qwen3(tiny(), rngs=nnx.Rngs(0))
    ecfg = EngineConfig(
        num_slots=CONC, max_seq_len=CONTEXT, prefill_chunk=32, prefill_batch=2, decode_steps=1
    )
    engine = Engine(model, TOK, ecfg)
    cfg = ServerConfig(host="127.0.0.1", port=0, model_name="tiny", shutdown_timeout_s=5.0)
    async with background_server(engine, TOK, cfg, start_timeout_s=180) as url:
        argv = ["bench/sim_latency.py", "--url", url, "--no-swe",
                "--trajectories", str(hist), "--concurrency", str(CONC),
                "--depths", ",".join(map(str, DEPTHS)), "--trials", "1",
                "--max-tokens", str(MAX_TOKENS), "--json", str(out)]  # fmt: skip
        before = dict(engine.stats)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *argv, cwd=REPO, stdout=PIPE, stderr=PIPE
        )
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=120)
        after = dict(engine.stats)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    doc = json.loads(out.read_text())
    return {"url": url, "doc": doc, "stdout": stdout.decode(), "before": before, "after": after}


async def test_cells_hold_real_histories_of_their_depth_cut_to_the_context(run):
    d = run["doc"]["detail"]
    assert (d["urls"], d["model"], d["context"]) == ([run["url"]], "tiny", CONTEXT)
    assert d["max_tokens"] == MAX_TOKENS and d["trials"] == 1
    cells = {(c["depth"], c["concurrency"]): c for c in d["cells"]}
    assert list(cells) == [(depth, CONC) for depth in DEPTHS]
    # depth 1 draws both real episodes; `long_first` keeps none of its turns (its one turn
    # does not fit), `short` its one: 0.5 kept on average
    one, three = cells[(1, CONC)], cells[(3, CONC)]
    assert [r["history"] for r in one["trial_runs"][0]["requests"]] == ["short", "long_first"]
    assert [r["kept_turns"] for r in one["trial_runs"][0]["requests"]] == [1, 0]
    # depth 3: `short` keeps its 3 turns, `long_first` the 2 after its long one
    assert [r["kept_turns"] for r in three["trial_runs"][0]["requests"]] == [3, 2]
    assert three["kept_turns"] == 2.5 and three["sources"] == ["collected"]
    for c in (one, three):
        assert c["requests"] == CONC and c["prompt_tokens_max"] <= CONTEXT - MAX_TOKENS
    assert one["prompt_tokens"] < three["prompt_tokens"]
    # no real episode has a command after 9 turns (the simulated one is left out)
    assert cells[(9, CONC)]["skipped"] == "none this deep"


async def test_tokens_caps_and_rates_agree_with_each_other_and_the_server(run):
    d = run["doc"]["detail"]
    done = [c for c in d["cells"] if not c["skipped"]]
    requests = [r for c in done for t in c["trial_runs"] for r in t["requests"]]
    warmup = d["warmup"]["requests"]
    assert len(warmup) == CONC  # one untimed trial at the largest concurrency
    for r in requests:
        # a cap hit generated all of max_tokens; an end-of-turn at most that
        assert (r["tokens"] == MAX_TOKENS) if r["cap_hit"] else (1 <= r["tokens"] <= MAX_TOKENS)
        assert 0 < r["wall_s"]
    for c in done:
        reqs = [r for t in c["trial_runs"] for r in t["requests"]]
        assert c["cap_hits"] == sum(r["cap_hit"] for r in reqs)
        assert c["tokens"] == sum(r["tokens"] for r in reqs)
        wall = c["trial_runs"][0]["wall_s"]
        assert c["wall_s"] == wall >= max(r["wall_s"] for r in reqs)  # cleared by the last
        assert c["tokens_per_s_aggregate"] == pytest.approx(c["tokens"] / wall)
        assert c["tokens_per_s_request"] > 0 and c["tokens_per_s_aggregate"] > 0
    # An untrained model seldom samples end-of-turn within 4 tokens: the cap is hit.
    assert sum(r["cap_hit"] for r in requests) >= 1
    # The server generated exactly what the bench counted, for every request it sent, and
    # reused no request's KV for another (each prompt starts with its own tag): at most the
    # ChatML header and the tag's opening bracket match, 9 tokens
    before, after = run["before"], run["after"]
    sent = requests + warmup
    assert after["generated_tokens"] - before["generated_tokens"] == sum(r["tokens"] for r in sent)
    assert after["prompt_tokens"] - before["prompt_tokens"] == sum(r["prompt_tokens"] for r in sent)
    assert after["cached_tokens"] - before["cached_tokens"] <= 10 * len(sent)


async def test_json_rows_and_printed_table(run):
    doc = run["doc"]
    assert doc["bench"] == "sim_latency"
    rows = doc["rows"]
    assert all(set(r) == ROW_KEYS and isinstance(r["ours"], int | float) for r in rows)
    where = [f"depth {depth}, {CONC} concurrent" for depth in DEPTHS[:2]]
    assert [(r["measure"], r["unit"]) for r in rows] == [
        row
        for w in where
        for row in (
            (f"wall to clear, {w}", "s"),
            (f"tokens/s per request, {w}", "tokens/s"),
            (f"tokens/s aggregate, {w} vs 1 at a time", "tokens/s"),
            (f"cap hits, {w}", f"of {CONC} requests"),
        )
    ]
    assert all(r["peer"] is None for r in rows)  # no concurrency-1 cell to compare with
    table = run["stdout"]
    for header in ("depth", "conc", "turns kept", "prompt tokens", "clear s", "cap hits"):
        assert header in table
    cells = {(c["depth"], c["concurrency"]): c for c in doc["detail"]["cells"]}
    for depth in DEPTHS[:2]:
        c = cells[(depth, CONC)]
        line = re.search(rf"│\s+{depth} │\s+{CONC} │\s+{CONC} │ coll\s+│.*│", table)
        assert line, table
        assert f"{c['cap_hits']}/{CONC}" in line.group(0)
        assert f"{c['wall_s']:.2f}" in line.group(0)
    assert re.search(rf"│\s+9 │\s+{CONC} │\s+0 │ none this deep", table), table


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # it imports bench/results.py
    spec = importlib.util.spec_from_file_location(
        "bench_sim_latency", REPO / "bench/sim_latency.py"
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look it up there
    spec.loader.exec_module(module)
    return module


async def test_collected_histories_are_real_shell_output(bench):
    got = await bench.collect_histories(2, 4, seed=3)
    assert [len(h.turns) for h in got] == [4, 4]
    assert all(h.source == "collected" for h in got)
    for h in got:
        for command, obs in h.turns:
            if command == "cat input.txt":  # the file the task set up, as bash printed it
                assert obs.output == h.setup_files["input.txt"]
            assert obs.exit_code == 0
    mixed = bench.interleave(["s1", "s2", "s3"], ["c1"])
    assert mixed == ["s1", "c1", "s2", "s3"]
