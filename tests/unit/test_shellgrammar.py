"""The utility grammar `simloop pretrain-sim` learns from: seeded, prefix-stable, in the textops
agent's own dialect where it claims to be, and every observation from real bash."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from collections import Counter

import pytest

from envs.config import STRING_OPS, GrammarConfig
from envs.shellgrammar import _PROGRAM, Case, Command, misspell_program, run_cases, sample_cases
from envs.terminal import SUBMIT_MARKER
from envs.textops import TRANSFORMS


def test_cases_are_seeded_and_prefix_stable():
    cfg = GrammarConfig(seed=3)
    assert sample_cases(cfg, 5) == sample_cases(cfg, 12)[:5]
    assert sample_cases(cfg, 4, offset=8) == sample_cases(cfg, 12)[8:]
    assert sample_cases(cfg, 5) != sample_cases(GrammarConfig(seed=4), 5)


def test_the_grammar_covers_operations_errors_and_bare_commands():
    cases = sample_cases(GrammarConfig(), 300)
    kinds = {c.kind for case in cases for c in case.commands}
    assert {"reverse", "upper", "sort", "count", "grammar:error"} <= kinds
    assert any(k.startswith("bare:") for k in kinds) and any(k.endswith(":typo") for k in kinds)
    assert any(not case.files for case in cases)  # bare cases: the word is in the command
    # The textops kinds are the textops agent's own pipelines over input.txt.
    for case in cases:
        for c in case.commands:
            if c.kind in ("reverse", "upper", "sort"):
                assert c.text.endswith(f"tr -d '\\n' < input.txt | {TRANSFORMS[c.kind]}")
            if c.kind == "count":
                assert "| wc -c" in c.text and "input.txt" in c.text


def test_operation_weights_and_typo_rate_shape_the_agents_commands():
    only_count = GrammarConfig(
        op_weights={"reverse": 0, "upper": 0, "sort": 0},
        error_prob=0.0,
        textops_prob=1.0,
        bare_prob=0.0,
    )
    kinds = [c.kind for case in sample_cases(only_count, 100) for c in case.commands]
    assert {k.split(":")[0] for k in kinds} == {"count"}
    heavy = GrammarConfig(
        op_weights={"sort": 3}, textops_prob=1.0, error_prob=0.0, bare_prob=0.0, typo_prob=0.0
    )
    kinds = [c.kind for case in sample_cases(heavy, 400) for c in case.commands]
    # sort weighs 3 of 6: 1,200 of 2,400 expected (sd 24.5); the others 400 each (sd ~18)
    assert 1050 < kinds.count("sort") < 1350 and 300 < kinds.count("upper") < 500
    typos = GrammarConfig(textops_prob=1.0, error_prob=0.0, bare_prob=0.0, typo_prob=1.0)
    assert all(c.kind.endswith(":typo") for case in sample_cases(typos, 50) for c in case.commands)


def test_program_typos_drop_a_character_of_a_program_name():
    typo = GrammarConfig(
        textops_prob=1.0, error_prob=0.0, bare_prob=0.0, typo_prob=1.0, program_typo_prob=1.0
    )
    programs = {"echo", "tr", "fold", "sort", "rev", "wc"}
    for case in sample_cases(typo, 60):
        for c in case.commands:
            assert c.kind.endswith(":typo")
            # Of the words where programs stand (line starts, after `|`), exactly one is no
            # longer a program: one of its characters went, and only there.
            named = [c.text[a:b] for a, b in (m.span(1) for m in _PROGRAM.finditer(c.text))]
            assert sum(w not in programs for w in named) == 1, c.text
            assert "input.txt" in c.text and ("'\\n'" in c.text)
    rng = random.Random(0)
    line = "tr -d '\\n' < input.txt | tr -cd 'q' | wc -c"
    seen = {misspell_program(line, rng) for _ in range(200)}
    assert "tr -d '\\n' < input.txt | tr -cd 'q' | w -c" in seen
    assert "tr -d '\\n' < input.txt | tr -cd 'q' | c -c" in seen
    # Only the program names lose a character: `tr`, `tr` and `wc`, each to one letter.
    assert seen == {
        "t -d '\\n' < input.txt | tr -cd 'q' | wc -c",
        "r -d '\\n' < input.txt | tr -cd 'q' | wc -c",
        "tr -d '\\n' < input.txt | t -cd 'q' | wc -c",
        "tr -d '\\n' < input.txt | r -cd 'q' | wc -c",
        "tr -d '\\n' < input.txt | tr -cd 'q' | w -c",
        "tr -d '\\n' < input.txt | tr -cd 'q' | c -c",
    }


def test_the_seeded_streams_of_earlier_runs_are_unchanged():
    """Knobs added since (`program_typo_prob`, `count_present_prob`, `count_near_miss_prob`)
    draw nothing at their defaults: the workspaces of run 14 (its grammar, seed 16) are the
    ones it was trained on. The digest was taken before those knobs existed."""
    cfg = GrammarConfig(
        seed=16, textops_prob=0.9, typo_prob=0.6, op_weights={"sort": 2, "count": 3}
    )
    cases = [
        [c.files, [[x.text, x.kind] for x in c.commands], c.session] for c in sample_cases(cfg, 50)
    ]
    digest = hashlib.sha256(json.dumps(cases).encode()).hexdigest()
    assert digest == "55ef28f1f1ba170de2f866104563386c4dc79f18c4d69a7359cead988f1acfb0"


def test_count_present_prob_sets_how_often_the_letter_is_in_the_word():
    def letters_in_word(prob: float) -> list[bool]:
        cfg = GrammarConfig(
            op_weights={"reverse": 0, "upper": 0, "sort": 0},
            error_prob=0.0,
            textops_prob=1.0,
            bare_prob=0.0,
            typo_prob=0.0,
            repeat_prob=0.0,
            min_len=4,
            max_len=8,
            count_present_prob=prob,
        )
        out = []
        for case in sample_cases(cfg, 100):
            word = case.files["input.txt"].strip()
            for c in case.commands:
                out.append(c.text.split("tr -cd '")[1][0] in word)
        return out

    assert all(letters_in_word(1.0))
    # Near misses: letters of the prompt around the word (its header, the command), not in it.
    cfg = GrammarConfig(
        op_weights={"reverse": 0, "upper": 0, "sort": 0},
        error_prob=0.0,
        textops_prob=1.0,
        bare_prob=0.0,
        typo_prob=0.0,
        min_len=4,
        max_len=8,
        count_present_prob=0.0,
        count_near_miss_prob=1.0,
    )
    drawn = Counter()
    for case in sample_cases(cfg, 100):
        word = case.files["input.txt"].strip()
        for c in case.commands:
            letter = c.text.split("tr -cd '")[1][0]
            assert letter not in word and letter in "tidrecnhoswpuxa" + "lkgy"
            drawn[letter] += 1
    # `t` is in the prompt 14 times of 66 letters (`start`, `the`, `input.txt` twice, `tr`...)
    # and `y` once: 600 draws put `t` well ahead (expected ~110+ against ~10).
    assert drawn["t"] > 3 * drawn["y"]
    # At 0, a letter drawn from the alphabet is in a 4-8-letter word at most 8/26 of the time
    # (~0.2 on average): 600 draws put the share far below 0.5.
    absent = letters_in_word(0.0)
    assert sum(absent) / len(absent) < 0.4


@pytest.mark.parametrize(
    "field,value",
    [
        ("min_len", 0),
        ("max_len", 0),
        ("repeat_prob", 1.5),
        ("bare_prob", -0.1),
        ("commands_per_case", 0),
        ("session_turns", 1),
        ("session_turns", 7),
        ("typo_prob", 2.0),
        ("program_typo_prob", -0.5),
        ("count_present_prob", 1.1),
        ("op_weights", {"rev": 1.0}),
        ("op_weights", {"sort": -1.0}),
        ("op_weights", dict.fromkeys(STRING_OPS, 0)),
    ],
)
def test_bad_grammar_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        GrammarConfig(**{field: value})


def test_observations_come_from_real_bash():
    case = Case(
        files={"input.txt": "banana\n"},
        commands=[
            Command(f"echo {SUBMIT_MARKER}\ntr -d '\\n' < input.txt | rev", "reverse"),
            Command("tr -d '\\n' < input.txt | tr a-z A-Z", "upper"),
            Command("tr -d '\\n' < input.txt | fold -w1 | sort | tr -d '\\n'", "sort"),
            Command("tr -d '\\n' < input.txt | tr -cd 'a' | wc -c", "count"),
            Command("cat nope.txt", "grammar:error"),
            Command("tr -d '\\n' < input.txt | rv", "grammar:error"),
        ],
    )
    (res,) = asyncio.run(run_cases([case]))
    outputs = [(out.strip(), code) for out, code in res.outputs]
    assert outputs[:4] == [(f"{SUBMIT_MARKER}\nananab", 0), ("BANANA", 0), ("aaabnn", 0), ("3", 0)]
    assert outputs[4][1] == 1 and "nope.txt" in outputs[4][0]
    assert outputs[5][1] == 127 and "rv" in outputs[5][0]
