"""SWE tasks from a task file (`envs/swe_file.py`), graded as SWE-bench grades them, on a small
local git repository (Python, pytest) in real sandboxes: a fix resolves, a wrong fix does not,
a diff that does not apply resolves nothing, a diff that edits the tests cannot make them pass
(the tests are restored before `test_patch`), and every invalid line of the file is named with
its field while the others load."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from envs.config import LocalShellConfig
from envs.local import LocalShell
from envs.rewards import RewardContext, compute_grade
from envs.swe_file import load_task_file, parse_pytest_summary
from tests.fakes import _git as git
from tests.fakes import calc_repo

pytestmark = pytest.mark.slow

BUGGY = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
OLD_TESTS = "from calc import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
NEW_TESTS = (
    "from calc import add, mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n\n\n"
    "def test_add():\n    assert add(2, 3) == 5\n"
)


def diff_of(repo: Path, path: str, text: str) -> str:
    """The unified diff that changes `path` to `text` (made with git, then undone)."""
    old = (repo / path).read_text()
    (repo / path).write_text(text)
    out = git(repo, "diff")
    (repo / path).write_text(old)
    return out


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("swe-file")
    repo, base = calc_repo(root / "calc", BUGGY, OLD_TESTS)
    test_patch = diff_of(repo, "tests/test_calc.py", NEW_TESTS)
    good = {
        "instance_id": "calc-1",
        "repo": "local/calc",
        "base_commit": base,
        "problem_statement": "add(a, b) returns a - b; it must return the sum.",
        "test_patch": test_patch,
        "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_add"]),  # SWE-bench's form
        "PASS_TO_PASS": ["tests/test_calc.py::test_mul"],
        "repo_path": "calc",  # relative to the task file
        "test_cmd": f"{sys.executable} -m pytest -rA -p no:cacheprovider",
        "hints_text": "ignored",
    }
    lines = [
        json.dumps(good),
        json.dumps({k: v for k, v in good.items() if k != "test_patch"} | {"instance_id": "b"}),
        json.dumps(good | {"instance_id": "c", "FAIL_TO_PASS": "not json"}),
        json.dumps(good | {"instance_id": "d", "base_commit": "0" * 40}),
        json.dumps({k: v for k, v in good.items() if k != "repo_path"} | {"image": "x/y:1"}),
        "{not json",
        json.dumps(good),  # the same instance_id again
    ]
    path = root / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, repo


def test_every_bad_line_is_named_with_its_field_and_the_rest_load(task_file):
    path, _ = task_file
    loaded = load_task_file(path)
    assert [t.id for t in loaded.tasks] == ["calc-1"]
    want = [
        (2, "test_patch: missing"),
        (3, "FAIL_TO_PASS: a list of test ids"),
        (4, "base_commit: '0000"),
        (5, "image: simloop has no container backend"),
        (6, "not JSON"),
        (7, "instance_id: 'calc-1' appears on an earlier line"),
    ]
    assert len(loaded.errors) == len(want), loaded.errors
    for (line, text), error in zip(want, loaded.errors, strict=True):
        assert error.startswith(f"{path}:{line}: ") and text in error, error
    task = loaded.tasks[0]
    assert task.family == "swe" and task.reward.name == "swe_bench"
    assert task.reward.params["test_files"] == ["tests/test_calc.py"]


async def _grade(task, diff: str):
    shell_cfg = LocalShellConfig(visible_paths=[sys.prefix, sys.base_prefix])
    ctx = RewardContext(shell_factory=lambda setup: LocalShell(shell_cfg, setup=setup))
    return await compute_grade(task, diff, ctx)


async def test_graded_as_swe_bench_grades(task_file):
    path, repo = task_file
    (task,) = load_task_file(path).tasks
    fix = diff_of(repo, "calc.py", BUGGY.replace("a - b", "a + b"))
    wrong = diff_of(repo, "calc.py", BUGGY.replace("a - b", "a * b"))
    cheat = diff_of(repo, "tests/test_calc.py", OLD_TESTS + "\n\ndef test_add():\n    pass\n")
    broken = fix.replace("a + b", "a + b + c").replace("a - b", "a / b")  # context mismatch

    resolved = await _grade(task, fix)
    assert resolved.reward == 1.0 and resolved.details["resolved"], resolved.details
    assert resolved.details["tests"] == {
        "tests/test_calc.py::test_add": "PASSED",
        "tests/test_calc.py::test_mul": "PASSED",
    }
    assert resolved.details["FAIL_TO_PASS"] == {"passed": 1, "of": 1}

    not_resolved = await _grade(task, wrong)
    assert not_resolved.reward == 0.0 and not_resolved.details["diff_applied"]
    assert not_resolved.details["tests"]["tests/test_calc.py::test_add"] == "FAILED"
    assert not_resolved.details["tests"]["tests/test_calc.py::test_mul"] == "PASSED"

    not_applied = await _grade(task, broken)
    assert not_applied.reward == 0.0 and not not_applied.details["diff_applied"]
    assert "does not apply" in not_applied.details["reason"]

    # Editing the tests buys nothing: they are restored, then test_patch applies as written.
    cheated = await _grade(task, cheat)
    assert cheated.reward == 0.0 and cheated.details["diff_applied"], cheated.details
    assert cheated.details["tests"]["tests/test_calc.py::test_add"] == "FAILED"
    both = await _grade(task, fix + cheat)  # the fix still counts, the test edit does not
    assert both.reward == 1.0, both.details


def test_the_pytest_summary_is_read_by_test_id():
    out = (
        "==== short test summary info ====\n"
        "PASSED tests/a.py::test_x\n"
        "FAILED tests/a.py::test_y[1-2] - AssertionError: no\n"
        "ERROR tests/b.py::test_z - ImportError\n"
        "XFAIL tests/a.py::test_w - reason\n"
        "SKIPPED [1] tests/a.py:9: why\n"
    )
    assert parse_pytest_summary(out) == {
        "tests/a.py::test_x": "PASSED",
        "tests/a.py::test_y[1-2]": "FAILED",
        "tests/b.py::test_z": "ERROR",
        "tests/a.py::test_w": "XFAIL",
    }


def test_a_job_takes_the_file_from_its_config_skipping_bad_lines_on_stderr(task_file, capsys):
    from launch.config.loading import ConfigError, load_config
    from launch.config.schema import SimloopConfig
    from launch.errors import UsageError
    from launch.jobs.harness import swe_tasks

    path, _ = task_file
    config = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"
    cfg = load_config(SimloopConfig, config, ["--train_agent.tasks", f"file:{path}"])
    assert cfg.train_agent.swe and cfg.train_agent.task_file == str(path)
    assert [t.id for t in swe_tasks(cfg)] == ["calc-1"]
    err = capsys.readouterr().err
    assert err.count("simloop: skipping ") == 6 and f"{path}:2: test_patch" in err
    picked = load_config(SimloopConfig, config, ["--harness.task_file", str(path)])
    assert [t.id for t in swe_tasks(picked)] == ["calc-1"]
    missing = load_config(
        SimloopConfig, config, ["--harness.task_file", str(path), "--harness.tasks", "[nope]"]
    )
    with pytest.raises(UsageError, match=r"\['nope'\] are not instances"):
        swe_tasks(missing)
    for bad in ("file:", "swe-bench", "files:x"):
        with pytest.raises(ConfigError, match="file:PATH"):
            load_config(SimloopConfig, config, ["--train_agent.tasks", bad])
