"""bench/harness_clients.py's arithmetic on recorded rollouts (the bench itself runs the real
clients; tests/integration/test_npm_harnesses.py runs them in CI)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import harness_clients as hc  # noqa: E402


def run(turns, requests, prompts, request_s, agent_s, new):
    return {
        "turns": turns,
        "requests": requests,
        "sampled": len(prompts),
        "prompt_tokens": prompts,
        "request_s": request_s,
        "agent_s": agent_s,
        "not_spliced": max(new - 1, 0),
    }


def test_rows_average_over_rollouts_and_requests():
    done = {
        "per_client": {
            # two rollouts: 4 + 2 turns, 5 + 2 requests (one token count), 6 sampled calls
            "claude-code": [
                run(4, 5, [100, 110, 120, 130], 4.4, 4.0, new=1),
                run(2, 2, [100, 200], 2.2, 2.0, new=2),
            ]
        }
    }
    rows = {r.measure.split(": ", 1)[1]: r for r in hc.rows_of(done)}
    assert rows["turns per rollout"].ours == 3.0
    assert rows["requests per turn"].ours == 7 / 6
    assert rows["prompt tokens per request (mean)"].ours == 760 / 6
    over = rows["middleware overhead per request vs its agent-server call"]
    assert over.ours == pytest.approx(1000 * 0.6 / 6) and over.peer == pytest.approx(1000)
    assert rows["middleware overhead, share of the agent-server call"].ours == pytest.approx(10)
    assert rows["share of turns not spliced onto the turn before"].ours == 1 / 6


def test_unknown_clients_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        hc.parse_args(["--clients", "claude-code,aider"])
    assert "['aider'] is invalid" in capsys.readouterr().err
