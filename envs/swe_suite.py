"""A small built-in suite of SWE-style tasks: tiny Python repositories whose unittest suite
fails until one bug is fixed, each with its reference fix (the fixed file), graded by
`envs.swe`'s `swe_tests` reward (the diff applied in a fresh shell, the tests restored, then
`python3 -m unittest`).

    from envs.swe_suite import swe_suite
    tasks = swe_suite()                       # every task
    tasks = swe_suite(["clamp", "slugify"])   # some

They are for driving unmodified agent harnesses end to end on a CPU (`simloop harness`,
`train-agent` with `train_agent.tasks: swe`); a tiny model will not solve them, but its
trajectories are real, token-exact and graded. `REFERENCE_FIXES[task id]` maps a file to its
fixed text: applied as the agent's diff, the task's tests pass (tests/unit/test_swe_suite.py).
"""

from __future__ import annotations

from envs.swe import make_swe_task
from envs.tasks import Task

TEST_COMMAND = "python3 -m unittest discover -s tests -q"

_TASKS: dict[str, dict] = {
    "clamp": {
        "instruction": (
            "tests/test_clamp.py fails: clamp(5, 0, 3) returns 0 instead of 3. Fix clamp() in "
            "clamp.py so that it keeps a value inside [lo, hi]. Do not edit the tests."
        ),
        "files": {
            "clamp.py": (
                "def clamp(x, lo, hi):\n"
                '    """x limited to the closed interval [lo, hi]."""\n'
                "    return max(lo, min(x, lo))\n"
            ),
            "tests/test_clamp.py": (
                "import unittest\n\nfrom clamp import clamp\n\n\n"
                "class TestClamp(unittest.TestCase):\n"
                "    def test_inside(self):\n        self.assertEqual(clamp(2, 0, 3), 2)\n\n"
                "    def test_above(self):\n        self.assertEqual(clamp(5, 0, 3), 3)\n\n"
                "    def test_below(self):\n        self.assertEqual(clamp(-1, 0, 3), 0)\n"
            ),
        },
        "fix": {
            "clamp.py": (
                "def clamp(x, lo, hi):\n"
                '    """x limited to the closed interval [lo, hi]."""\n'
                "    return max(lo, min(x, hi))\n"
            ),
        },
    },
    "wordcount": {
        "instruction": (
            "count_words('a  b\\nc') should be 3 but wordcount.py returns 4: runs of spaces and "
            "newlines separate words too. Fix count_words(). Do not edit the tests."
        ),
        "files": {
            "wordcount.py": (
                "def count_words(text):\n"
                '    """How many whitespace-separated words `text` holds."""\n'
                '    return len(text.split(" ")) if text else 0\n'
            ),
            "tests/test_wordcount.py": (
                "import unittest\n\nfrom wordcount import count_words\n\n\n"
                "class TestCount(unittest.TestCase):\n"
                "    def test_simple(self):\n"
                '        self.assertEqual(count_words("a b c"), 3)\n\n'
                "    def test_runs_of_space(self):\n"
                '        self.assertEqual(count_words("a  b\\nc"), 3)\n\n'
                "    def test_empty(self):\n"
                '        self.assertEqual(count_words("   "), 0)\n'
            ),
        },
        "fix": {
            "wordcount.py": (
                "def count_words(text):\n"
                '    """How many whitespace-separated words `text` holds."""\n'
                "    return len(text.split())\n"
            ),
        },
    },
    "fizzbuzz": {
        "instruction": (
            "fizzbuzz(15) must return 15 items, the last one 'FizzBuzz', but fizzbuzz.py stops "
            "one short. Fix fizzbuzz(). Do not edit the tests."
        ),
        "files": {
            "fizzbuzz.py": (
                "def fizzbuzz(n):\n"
                "    out = []\n"
                "    for i in range(1, n):\n"
                "        word = ('Fizz' if i % 3 == 0 else '') + ('Buzz' if i % 5 == 0 else '')\n"
                "        out.append(word or str(i))\n"
                "    return out\n"
            ),
            "tests/test_fizzbuzz.py": (
                "import unittest\n\nfrom fizzbuzz import fizzbuzz\n\n\n"
                "class TestFizzBuzz(unittest.TestCase):\n"
                "    def test_length(self):\n        self.assertEqual(len(fizzbuzz(15)), 15)\n\n"
                "    def test_last(self):\n"
                "        self.assertEqual(fizzbuzz(15)[-1], 'FizzBuzz')\n\n"
                "    def test_start(self):\n"
                "        self.assertEqual(fizzbuzz(3), ['1', '2', 'Fizz'])\n"
            ),
        },
        "fix": {
            "fizzbuzz.py": (
                "def fizzbuzz(n):\n"
                "    out = []\n"
                "    for i in range(1, n + 1):\n"
                "        word = ('Fizz' if i % 3 == 0 else '') + ('Buzz' if i % 5 == 0 else '')\n"
                "        out.append(word or str(i))\n"
                "    return out\n"
            ),
        },
    },
    "slugify": {
        "instruction": (
            "slugify('  Hello World ') should be 'hello-world'; slug.py returns "
            "'__hello_world_'. Words are joined by '-' and outer spaces dropped. Fix slugify(). "
            "Do not edit the tests."
        ),
        "files": {
            "slug.py": ("def slugify(title):\n    return title.lower().replace(' ', '_')\n"),
            "tests/test_slug.py": (
                "import unittest\n\nfrom slug import slugify\n\n\n"
                "class TestSlug(unittest.TestCase):\n"
                "    def test_words(self):\n"
                "        self.assertEqual(slugify('Hello World'), 'hello-world')\n\n"
                "    def test_outer_space(self):\n"
                "        self.assertEqual(slugify('  Hello World '), 'hello-world')\n"
            ),
        },
        "fix": {
            "slug.py": ("def slugify(title):\n    return '-'.join(title.lower().split())\n"),
        },
    },
}

TASK_IDS: tuple[str, ...] = tuple(_TASKS)
REFERENCE_FIXES: dict[str, dict[str, str]] = {k: v["fix"] for k, v in _TASKS.items()}


def swe_suite(ids: list[str] | tuple[str, ...] | None = None) -> list[Task]:
    """The suite's tasks (all, or those named), in order; unknown ids raise ValueError."""
    ids = list(TASK_IDS if ids is None else ids)
    unknown = [i for i in ids if i not in _TASKS]
    if unknown:
        raise ValueError(f"unknown swe suite tasks {unknown}: one of {list(TASK_IDS)}")
    tasks = []
    for task_id in ids:
        spec = _TASKS[task_id]
        tests = tuple(p for p in spec["files"] if p.startswith("tests/"))
        tasks.append(
            make_swe_task(
                f"swe-{task_id}",
                spec["instruction"],
                dict(spec["files"]),
                TEST_COMMAND,
                protected=tests,
                timeout_s=60.0,
            )
        )
    return tasks
