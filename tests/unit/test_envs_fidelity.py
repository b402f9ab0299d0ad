"""Fidelity metrics on hand-made pairs, and over the real SWE-agent observations."""

import json
import math
import random

import pytest

from envs.fidelity import (
    PairMetrics,
    compare_observations,
    compression_ratio,
    is_repetitive,
    mask_volatile,
    observation_hygiene,
    similarity,
    suggest_max_tokens,
    summarize_by,
    summarize_hygiene,
    summarize_pairs,
)

LS_A = "-rw-r--r-- 1 user user 120 Jan  3 10:42 notes.txt\n"
LS_B = "-rw-r--r-- 1 user user 120 Mar 17 09:05 notes.txt\n"


@pytest.mark.parametrize(
    "a, b",
    [
        ("started 2024-05-01T12:00:01Z", "started 2025-11-21 08:13:59.123+02:00"),
        ("Mon Jan  1 10:00:00 UTC 2024\n", "Tue Mar  5 23:59:59 UTC 2024\n"),
        (LS_A, LS_B),
        ("<object at 0x7ffd5c3a1b20>", "<object at 0x55d1c0ffee00>"),
        ("commit 3f2a9c1d8e\nAuthor: x", "commit 9b8e7d6c5a\nAuthor: x"),
        ("real\t0m0.003s\nuser\t0m0.001s", "real\t0m1.250s\nuser\t0m0.900s"),
        ("Ran 3 tests in 0.012s\n\nOK", "Ran 3 tests in 1.5s\n\nOK"),
        ("[1] 4242\n", "[1] 917\n"),
        ("server pid: 1234 started", "server pid: 98 started"),
        ("wrote /tmp/tmpab12_x9/out", "wrote /tmp/tmpzz34q/out"),
    ],
)
def test_volatile_content_is_masked(a, b):
    m = compare_observations(a, b, 0, 0)
    assert not m.exact and m.exact_masked and m.similarity == 1.0


@pytest.mark.parametrize(
    "text",
    [
        "hello world 42 files\n",
        "1 selected, 3 seconds-per-item mode",
        "deadbeef facade",  # hex letters without digits are words
        "chr() arg not in range(0x110000)",  # short constants stay
        "line 12, in <module>",
    ],
)
def test_ordinary_content_is_not_masked(text):
    assert mask_volatile(text) == text


def test_pair_metrics_on_hand_made_pairs():
    same = compare_observations("a\nb\n", "a\nb\n", 0, 0)
    assert same == PairMetrics(True, True, True, 1.0, 1.0)
    other = compare_observations("total 0\n", "Traceback (most recent call last):\n", 0, 1)
    assert not other.exact_masked and other.exit_code_match is False and other.similarity < 0.2
    lines = [f"line {i} of the file" for i in range(20)]
    edited = lines.copy()
    edited[7] = "a different line entirely"
    close = compare_observations("\n".join(edited), "\n".join(lines))
    assert 0.8 < close.similarity < 1.0 and close.exit_code_match is None
    assert compare_observations("a" * 99, "a" * 49).length_ratio == 2.0
    assert similarity("", "") == 1.0 and similarity("x", "") == 0.0


def test_summaries():
    pairs = [
        compare_observations("a" * 99, "a" * 49, 0, 0),
        compare_observations("a" * 49, "a" * 99, 1, 0),
        compare_observations("x", "x"),
    ]
    s = summarize_pairs(pairs)
    assert s["count"] == 3 and s["exact"] == pytest.approx(1 / 3)
    assert s["length_ratio_geomean"] == pytest.approx(1.0)
    assert s["exit_code_agreement"] == 0.5  # only pairs with both codes count
    by = summarize_by([(10, pairs[0]), (600, pairs[1]), (5000, pairs[2])], [512, 4096])
    assert {k: v["count"] for k, v in by.items()} == {"0-512": 1, "512-4096": 1, "4096-inf": 1}
    assert summarize_pairs([]) == {"count": 0}


def test_hygiene_flags():
    rng = random.Random(0)
    noise = "".join(rng.choice("abcdefghij0123456789 \n") for _ in range(4000))
    trace = 'Traceback (most recent call last):\n  File "a.py", line 1\nNameError: x\n'
    assert is_repetitive("same line\n" * 20) and is_repetitive("ab" * 1000)
    assert not is_repetitive(noise) and not is_repetitive(trace)
    assert not is_repetitive("ok\nok\nok\n")  # too few lines to call it a loop
    assert compression_ratio("ab" * 1000) < 0.05 < compression_ratio(noise)
    h = observation_hygiene("<think>x</think>out", finish_reason="length")
    assert h.cap_hit and h.think_leak and not h.empty and not h.repetition
    assert observation_hygiene("  \n").empty
    rates = summarize_hygiene([h, observation_hygiene("fine")])
    assert rates["cap_hit"] == 0.5 and rates["count"] == 2


def test_suggest_max_tokens_sits_near_real_lengths():
    lengths = list(range(1, 101))  # 1..100 tokens
    assert suggest_max_tokens(lengths) == 124  # 99th percentile (99) x 1.25
    assert suggest_max_tokens(lengths, quantile=0.5, slack=1.0) == 50
    assert suggest_max_tokens([3, 4]) == 32  # never below the floor
    with pytest.raises(ValueError, match="quantile=0 is invalid"):
        suggest_max_tokens(lengths, quantile=0)


def real_observations(root) -> list[str]:
    """Observation strings of every step of every .traj file."""
    out = []
    for path in sorted(root.glob("*.traj")):
        for step in json.loads(path.read_text())["trajectory"]:
            if isinstance(step.get("observation"), str):
                out.append(step["observation"])
    return out


def test_metrics_run_over_real_trajectories(swe_agent_trajectories):
    observations = real_observations(swe_agent_trajectories)
    assert len(observations) > 100
    hygiene = summarize_hygiene([observation_hygiene(o) for o in observations])
    assert hygiene["think_leak"] == 0.0 and hygiene["cap_hit"] == 0.0
    assert hygiene["repetition"] < 0.05  # real terminals rarely loop
    self_pairs = summarize_pairs([compare_observations(o, o, 0, 0) for o in observations])
    assert self_pairs["exact_masked"] == 1.0 and self_pairs["similarity"] == 1.0
    # Neighbouring observations of the same episode are different outputs.
    pairs = zip(observations, observations[1:], strict=False)
    neighbours = [compare_observations(a, b) for a, b in pairs]
    summary = summarize_pairs(neighbours)
    assert 0.0 < summary["similarity"] < 0.5
    assert all(0.0 <= m.similarity <= 1.0 and math.isfinite(m.length_ratio) for m in neighbours)
