"""SWE tasks from a file, graded as SWE-bench grades them (`train_agent.tasks: file:PATH`,
`harness.task_file`).

One JSON object per line, in the SWE-bench / SWE-Gym shape:

    {"instance_id": "calc-1", "repo": "me/calc", "base_commit": "3f2a...",
     "problem_statement": "add() subtracts ...", "test_patch": "diff --git a/tests/...",
     "FAIL_TO_PASS": ["tests/test_calc.py::test_add"], "PASS_TO_PASS": ["tests/..."],
     "repo_path": "/data/repos/calc", "setup_commands": ["pip install -e ."],
     "test_cmd": "python -m pytest -rA -p no:cacheprovider", "timeout_s": 300}

- `instance_id`, `problem_statement` (what the agent is told), `base_commit`, `test_patch`,
  `FAIL_TO_PASS` and `PASS_TO_PASS` are required. The two test lists are pytest node ids, as
  lists or as the JSON strings of lists that SWE-bench's datasets hold.
- Where the repository comes from: `repo_path`, a local git repository holding `base_commit`.
  It is packed into the task as a git bundle (its refs), so any sandbox (local, E2B) starts
  from an identical checkout at `base_commit` without reaching the host's disk or a network.
  `e2b_template` (optional) picks the E2B template the instance's sandboxes start from (its
  installed dependencies), the repository still coming from the bundle. A container `image`
  alone, or a template's own checkout with no `repo_path`, is refused by name: simloop has no
  container backend, and a template's checkout is not one it can verify at `base_commit`.
- `setup_commands` run in the checkout after it (e.g. an offline `pip install -e .`);
  `test_cmd` is the test runner, given the test ids (default
  `python -m pytest -rA -p no:cacheprovider`; it must print pytest's `-rA` summary);
  `timeout_s` bounds it. Other keys (`patch`, `hints_text`, `version`, ...) are ignored.

A line that is not valid gets a message naming the line and the field; the other lines load.

Grading (`swe_bench` reward), in a fresh sandbox at `base_commit`: the agent's diff is applied
(a diff that does not apply resolves nothing), the files `test_patch` touches are restored to
`base_commit` (so a diff that edited the tests cannot change them), `test_patch` is applied, and
`test_cmd` runs every FAIL_TO_PASS and PASS_TO_PASS test. Resolved (reward 1) iff every one of
them passed (PASSED or XFAIL in the summary; a test the summary does not name did not pass).
The per-test results go with the trajectory (`Grade.details`).
"""

from __future__ import annotations

import base64
import json
import re
import shlex
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envs.rewards import Grade, RewardContext, register_reward
from envs.shell import TaskSetup
from envs.swe import APPLY_COMMAND, DIFF_FILE, upload_commands
from envs.tasks import RewardSpec, Task

REQUIRED = (
    "instance_id",
    "problem_statement",
    "base_commit",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
)
DEFAULT_TEST_CMD = "python -m pytest -rA -p no:cacheprovider"
BUNDLE = ".simloop_repo.bundle"
TEST_PATCH_FILE = ".simloop_test.patch"
PASSING = ("PASSED", "XFAIL")
_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS)\s+(\S+)")


@dataclass
class TaskFile:
    """What a task file held: the tasks of its valid lines and a message per invalid one."""

    tasks: list[Task] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def load_task_file(path: str | Path) -> TaskFile:
    """Every line of `path` as a `Task` (family `swe`, reward `swe_bench`); invalid lines are
    reported in `errors` (`PATH:LINE: field: what is wrong`), never raised. OSError when the
    file cannot be read."""
    path = Path(path)
    out = TaskFile()
    seen: set[str] = set()
    bundles: dict[str, str] = {}  # one bundle per repository, however many instances use it
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            task = instance_task(json.loads(line), base=path.parent, bundles=bundles)
            if task.id in seen:
                raise _Bad("instance_id", f"{task.id!r} appears on an earlier line")
            seen.add(task.id)
            out.tasks.append(task)
        except json.JSONDecodeError as e:
            out.errors.append(f"{path}:{n}: not JSON ({e.msg})")
        except _Bad as e:
            out.errors.append(f"{path}:{n}: {e.field}: {e.why}")
    return out


class _Bad(ValueError):
    def __init__(self, name: str, why: str):
        super().__init__(f"{name}: {why}")
        self.field, self.why = name, why


def _tests(obj: dict, key: str) -> list[str]:
    value = obj[key]
    if isinstance(value, str):  # SWE-bench's datasets: a JSON string of a list
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise _Bad(key, "a list of test ids (or its JSON string)") from None
    if not isinstance(value, list) or not all(isinstance(t, str) and t.strip() for t in value):
        raise _Bad(key, "a list of test ids (or its JSON string)")
    return list(value)


def instance_task(
    obj: Any, *, base: Path = Path("."), bundles: dict[str, str] | None = None
) -> Task:
    """One instance as a `Task`; `_Bad` (a ValueError) names the field. A relative `repo_path`
    is relative to `base` (the task file's folder); `bundles` keeps each repository's bundle
    for the next instance of it."""
    if not isinstance(obj, dict):
        raise _Bad("(line)", f"a JSON object, got {type(obj).__name__}")
    for key in REQUIRED:
        if key not in obj:
            raise _Bad(key, "missing (required)")
    for key in ("instance_id", "problem_statement", "base_commit", "test_patch"):
        if not isinstance(obj[key], str) or not obj[key].strip():
            raise _Bad(key, "a non-empty string")
    fail, keep = _tests(obj, "FAIL_TO_PASS"), _tests(obj, "PASS_TO_PASS")
    if not fail:
        raise _Bad("FAIL_TO_PASS", "at least one test the fix must make pass")
    setup_cmds = obj.get("setup_commands", [])
    if not isinstance(setup_cmds, list) or not all(
        isinstance(c, str) and c.strip() for c in setup_cmds
    ):
        raise _Bad("setup_commands", "a list of shell commands")
    test_cmd = obj.get("test_cmd", DEFAULT_TEST_CMD)
    if not isinstance(test_cmd, str) or not test_cmd.strip():
        raise _Bad("test_cmd", "a shell command that runs pytest with -rA")
    timeout = obj.get("timeout_s")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
    ):
        raise _Bad("timeout_s", "a number of seconds > 0")
    template = obj.get("e2b_template")
    if template is not None and (not isinstance(template, str) or not template.strip()):
        raise _Bad("e2b_template", "an E2B template id or name")
    repo_path = obj.get("repo_path")
    if repo_path is None:
        if obj.get("image") is not None:
            raise _Bad(
                "image",
                "simloop has no container backend: give repo_path (a local git repository; "
                "with e2b_template for the sandbox's dependencies)",
            )
        raise _Bad("repo_path", "missing: a local git repository holding base_commit")
    if not isinstance(repo_path, str) or not repo_path.strip():
        raise _Bad("repo_path", "a path to a local git repository")
    test_files = patched_files(obj["test_patch"])
    if not test_files:
        raise _Bad("test_patch", "a unified diff (no 'diff --git a/... b/...' header found)")
    bundle = _bundle(base / repo_path, obj["base_commit"], {} if bundles is None else bundles)
    base_commit = obj["base_commit"].strip()
    setup = TaskSetup(
        files={f"{BUNDLE}.b64": bundle},
        commands=(
            f"base64 -d {BUNDLE}.b64 > {BUNDLE} && rm -f {BUNDLE}.b64",
            f"git clone -q --no-checkout {BUNDLE} .simloop_clone && mv .simloop_clone/.git . "
            f"&& rmdir .simloop_clone && git remote remove origin && rm -f {BUNDLE}",
            f"git -c advice.detachedHead=false checkout -q {shlex.quote(base_commit)}",
            *setup_cmds,
        ),
    )
    params: dict[str, Any] = {
        "base_commit": base_commit,
        "test_patch": obj["test_patch"],
        "test_files": test_files,
        "FAIL_TO_PASS": fail,
        "PASS_TO_PASS": keep,
        "test_cmd": test_cmd,
    }
    if timeout is not None:
        params["timeout_s"] = float(timeout)
    metadata = {"repo": obj.get("repo") or str(repo_path)}
    if template is not None:
        metadata["e2b_template"] = template
    return Task(
        id=obj["instance_id"],
        instruction=obj["problem_statement"],
        setup=setup,
        reward=RewardSpec("swe_bench", params),
        family="swe",
        metadata=metadata,
    )


def patched_files(patch: str) -> list[str]:
    """The files a unified diff touches (both sides of a rename), in order."""
    out: list[str] = []
    for m in re.finditer(r"^diff --git a/(\S+) b/(\S+)$", patch, re.M):
        for p in m.groups():
            if p not in out:
                out.append(p)
    return out


def _bundle(repo: Path, commit: str, made: dict[str, str]) -> str:
    """`repo`'s refs as a git bundle, base64 (from `made` when an instance before bundled it);
    `_Bad` when it is not a repository holding `commit`."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, timeout=120, check=False
        )

    if not repo.is_dir() or git("rev-parse", "--git-dir").returncode != 0:
        raise _Bad("repo_path", f"{str(repo)!r} is not a git repository")
    if git("cat-file", "-e", f"{commit.strip()}^{{commit}}").returncode != 0:
        raise _Bad("base_commit", f"{commit!r} is not a commit of {str(repo)!r}")
    key = str(repo.resolve())
    if key not in made:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "repo.bundle"
            done = git("bundle", "create", str(out), "--all")
            if done.returncode != 0:
                why = done.stderr.decode(errors="replace").strip()[-300:]
                raise _Bad("repo_path", f"git bundle failed: {why}")
            made[key] = base64.b64encode(out.read_bytes()).decode()
    return made[key]


def parse_pytest_summary(output: str) -> dict[str, str]:
    """Test id -> outcome from pytest's `-rA` short summary (`PASSED id`, `FAILED id - ...`)."""
    out: dict[str, str] = {}
    for line in output.splitlines():
        m = _SUMMARY.match(line.strip())
        if m:
            out[m.group(2)] = m.group(1)
    return out


@register_reward("swe_bench")
async def swe_bench_reward(task: Task, submission: str | None, ctx: RewardContext) -> Grade:
    """1.0 iff, in a fresh sandbox at `base_commit` with the diff and then `test_patch`
    applied, every FAIL_TO_PASS and PASS_TO_PASS test passes (module docstring)."""
    p = task.reward.params
    if ctx.shell_factory is None:
        raise ValueError(f"task {task.id!r}: reward swe_bench needs RewardContext.shell_factory")
    fail, keep = list(p["FAIL_TO_PASS"]), list(p["PASS_TO_PASS"])
    details: dict[str, Any] = {"resolved": False, "diff_applied": False, "tests": {}}
    if submission is None or not submission.strip():
        details["reason"] = "no diff was submitted"
        return Grade(0.0, details)
    diff = submission if submission.endswith("\n") else submission + "\n"
    patch = p["test_patch"] if p["test_patch"].endswith("\n") else p["test_patch"] + "\n"
    timeout_s = float(p.get("timeout_s", ctx.timeout_s))
    async with ctx.shell_factory(task.setup) as shell:

        async def run(cmd: str, limit: float = ctx.timeout_s):
            return await shell.run(cmd, timeout_s=limit)

        for cmd in [*upload_commands(diff, DIFF_FILE), APPLY_COMMAND]:
            obs = await run(cmd)
            if obs.exit_code != 0:
                details["reason"] = f"the diff does not apply: {obs.output[-300:]}"
                return Grade(0.0, details)
        details["diff_applied"] = True
        files = " ".join(shlex.quote(f) for f in p["test_files"])
        restore = (
            f"for f in {files}; do "
            f'if git cat-file -e {shlex.quote(p["base_commit"])}:"$f" 2>/dev/null; '
            f'then git checkout -q {shlex.quote(p["base_commit"])} -- "$f"; else rm -f "$f"; fi; '
            "done"
        )
        apply_tests = f"git apply --whitespace=nowarn {TEST_PATCH_FILE} && rm -f {TEST_PATCH_FILE}"
        for cmd in [restore, *upload_commands(patch, TEST_PATCH_FILE), apply_tests]:
            obs = await run(cmd)
            if obs.exit_code != 0:
                details["reason"] = f"the test patch does not apply: {obs.output[-300:]}"
                return Grade(0.0, details)
        ids = " ".join(shlex.quote(t) for t in dict.fromkeys([*fail, *keep]))
        obs = await run(f"{p['test_cmd']} {ids}", timeout_s)
    outcome = parse_pytest_summary(obs.output)
    tests = {t: outcome.get(t, "missing") for t in [*fail, *keep]}
    details["tests"] = tests
    details["test_exit_code"] = obs.exit_code
    details["FAIL_TO_PASS"] = _passed(fail, tests)
    details["PASS_TO_PASS"] = _passed(keep, tests)
    resolved = all(tests[t] in PASSING for t in [*fail, *keep])
    details["resolved"] = resolved
    if not resolved:
        details["reason"] = "; ".join(f"{t}: {s}" for t, s in tests.items() if s not in PASSING)[
            :500
        ]
    return Grade(1.0 if resolved else 0.0, details)


def _passed(ids: Sequence[str], tests: dict[str, str]) -> dict[str, int]:
    return {"passed": sum(tests[t] in PASSING for t in ids), "of": len(ids)}
