"""Unmodified agent harnesses as the rollout source: one harness run per (task, sample), inside
the task's sandbox, pointed at `simloop middleware`, graded in a second clean sandbox.

Per rollout (`HarnessRunner.run_one`):
1. the sandbox starts with the task's setup (a git repository for swe tasks) from the job's
   real shell backend (local bash or E2B);
2. the harness runs there, with its model pointed at the middleware and its API key set to the
   rollout id (`mini-swe-agent`: its litellm `openai/` model with `api_base` and `api_key`;
   `command`: any command line, with `{base_url}`, `{api_key}`, `{task_file}`, `{python}`),
   under a wall-clock guard (`wall_s`: the shell kills its process group; the rollout is
   `truncated`, its turns so far kept and graded like a finished one's);
3. its diff (`git add -A && git diff --cached`, the harness's own files excluded) is graded
   by the task's reward in a fresh sandbox (`envs.swe`: apply, restore protected tests, run
   the test command);
4. `POST /rollouts/{id}/finish` on the middleware's admin listener (`AdminAccess`: a Unix
   socket or URL, and the token; never shown to the sandbox) turns the rollout's segments
   into trajectories with that reward; they come back in the reply's `trajectories` count and
   are written by the middleware's sink. A finish the middleware refuses is logged and the
   result carries the error; the middleware then writes the rollout `aborted` once
   `rollout_ttl_s` passes without a grade.

The runner never imports the middleware: it speaks to it over HTTP like any harness, and
finishes rollouts through the admin listener the job that started the middleware hands it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from envs.backends import ShellFactory
from envs.rewards import Grade, RewardContext, get_reward
from envs.swe import upload_commands
from envs.tasks import Task
from rl import validate
from rl.data.trajectory import Exclusion
from rl.orchestrator.buffer import stale_exclusion

log = logging.getLogger(__name__)

HARNESSES = ("mini-swe-agent", "claude-code", "codex", "command")
NPM_PACKAGES = {
    "claude-code": ("@anthropic-ai/claude-code", "claude"),
    "codex": ("@openai/codex", "codex"),
}
"""npm-installed harnesses: (package, the executable it installs)."""
CLOSE_GRACE_S = 15.0
"""How long `HarnessSource.close()` waits for cancelled rollouts to wind down."""
WORK_DIR = ".simloop-harness"
"""The harness's files in the sandbox (config, task text, its own trajectory), git-excluded."""


@dataclass(frozen=True)
class HarnessConfig:
    """`simloop harness` / harness-driven RL: which agent runs, and its limits."""

    kind: str = "mini-swe-agent"
    """`mini-swe-agent` (PyPI `mini-swe-agent`, unmodified), `claude-code` (npm
    `@anthropic-ai/claude-code`, unmodified, in print mode against the middleware's Anthropic
    API), `codex` (npm `@openai/codex`, unmodified, `codex exec` against its Responses API) or
    `command` (`command` below)."""
    npm_version: str | None = None
    """The pinned npm version of `claude-code` / `codex`, installed into `npm_cache` when
    missing. Default: `NPM_VERSIONS` (the versions the tests run)."""
    npm_cache: str | None = None
    """Where npm harnesses are installed (`<package>@<version>/` each); the sandbox sees it
    read-only. Default: `~/.cache/simloop/npm`."""
    command: str | None = None
    """`kind: command`: the command line, run in the sandbox's working directory, with
    `{base_url}` (the middleware), `{api_key}` (the rollout id), `{task_file}` (the task
    text's path) and `{python}` (a Python the sandbox can run, with this one's packages)
    filled in."""
    executable: str | None = None
    """How the sandbox starts mini-swe-agent (a program, or a command prefix). Default: the
    first that runs in the sandbox of `mini` beside this Python and, where that Python is
    out of the sandbox user's reach (a root install under a private home), this Python's
    packages imported by a system Python of the same version."""
    base_url: str | None = None
    """The middleware as the sandbox reaches it (default: where it listens; an E2B sandbox
    needs a public URL)."""
    model: str = "simloop-agent"
    """The model name the harness asks for."""
    step_limit: int = 8
    """mini-swe-agent: model calls per rollout."""
    max_tokens: int = 256
    """Tokens per model call."""
    temperature: float = 1.0
    wall_s: float = 600.0
    """Wall-clock guard of one harness run; past it the run is killed and recorded `truncated`
    (with the reason): the turns it made are trained, on the grade of the diff it left."""
    grade_timeout_s: float = 120.0
    """Budget of each grading command (the tests)."""
    concurrency: int = 4
    """Harness runs at once."""
    finish_timeout_s: float = 120.0
    extra_env: dict[str, str] = field(default_factory=dict)
    """More environment variables for the harness process."""
    tasks: list[str] = field(default_factory=list)
    """`simloop harness`: ids of the built-in swe suite (`envs.swe_suite`); empty: all. With
    `task_file`: ids of its instances; empty: all."""
    task_file: str | None = None
    """SWE-bench-shaped instances (JSONL, `envs.swe_file`) in place of the built-in suite,
    graded as SWE-bench grades them; `train_agent.tasks: file:PATH` sets it."""
    samples: int = 1
    """`simloop harness`: rollouts per task."""

    def __post_init__(self) -> None:
        validate.one_of(self, "kind", HARNESSES)
        validate.require(
            self.task_file is None or (isinstance(self.task_file, str) and self.task_file),
            self,
            "task_file",
            "a path to a JSONL file of SWE-bench-shaped instances, or null",
        )
        validate.require(
            self.kind != "command" or self.command,
            self,
            "command",
            "a command line when kind is 'command'",
        )
        validate.integer(self, "step_limit", "max_tokens", "concurrency", "samples", low=1)
        validate.positive(
            self, "wall_s", "grade_timeout_s", "finish_timeout_s", allowed="a number of seconds > 0"
        )
        validate.number(self, "temperature", low=0, high=2)


@dataclass(frozen=True)
class AdminAccess:
    """The middleware's admin listener, as the job that started it hands it to the runner:
    a Unix socket path or a URL, and the bearer token. Never shown to a sandbox."""

    token: str = field(repr=False)
    socket: str | None = None
    url: str | None = None

    def __post_init__(self) -> None:
        if (self.socket is None) == (self.url is None):
            raise ValueError(
                f"AdminAccess needs a socket or a url, exactly one; got "
                f"socket={self.socket!r}, url={self.url!r}"
            )
        if not self.token:
            raise ValueError("AdminAccess.token must be a non-empty string")

    def session(self, timeout_s: float) -> aiohttp.ClientSession:
        """A client session to the admin listener; paths go after `base`."""
        connector = aiohttp.UnixConnector(path=self.socket) if self.socket else None
        return aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            headers={"Authorization": f"Bearer {self.token}"},
        )

    @property
    def base(self) -> str:
        return "http://middleware" if self.socket else str(self.url).rstrip("/")


@dataclass
class HarnessResult:
    """One finished rollout, as the runner and the middleware saw it."""

    rollout_id: str
    task_id: str
    group_id: str
    reward: float | None
    status: str
    reason: str | None
    exit_code: int | None
    wall_s: float
    diff: str
    finish: dict[str, Any] = field(default_factory=dict)
    """The middleware's answer to the finish call (trajectories written, segments, plans);
    `error` when the finish failed or was refused (nothing written with this reward)."""

    def summary(self) -> dict[str, Any]:
        return {
            "rollout_id": self.rollout_id,
            "task_id": self.task_id,
            "reward": self.reward,
            "status": self.status,
            "reason": self.reason,
            "exit_code": self.exit_code,
            "wall_s": round(self.wall_s, 3),
            "diff_bytes": len(self.diff.encode()),
            "trajectories": self.finish.get("trajectories"),
            "segments": len(self.finish.get("segments", [])),
            "finish_error": self.finish.get("error"),
        }


def rollout_id_for(task: Task, group: str, index: int) -> str:
    """A fresh rollout id (the harness's API key): readable, unique, within the key charset."""
    base = re.sub(r"[^A-Za-z0-9._-]", "_", f"{task.id}.{group}.{index}")[:100]
    return f"{base}.{secrets.token_hex(4)}"


class HarnessUnavailable(RuntimeError):
    """The harness cannot be started inside the sandbox."""


NPM_VERSIONS = {"claude-code": "2.1.328", "codex": "0.171.0"}
"""The versions `tests/integration/test_claude_code.py` and `test_codex.py` run."""


def npm_version(cfg: HarnessConfig) -> str:
    return cfg.npm_version or NPM_VERSIONS[cfg.kind]


class NpmUnavailable(HarnessUnavailable):
    """An npm harness cannot be installed: no npm, or the registry cannot be reached."""


def npm_root(cfg: HarnessConfig) -> Path:
    """The folder an npm harness of `cfg` is installed in."""
    package, _ = NPM_PACKAGES[cfg.kind]
    cache = Path(cfg.npm_cache or Path.home() / ".cache" / "simloop" / "npm").expanduser()
    return cache / f"{package.replace('/', '+')}@{npm_version(cfg)}"


def install_npm_harness(cfg: HarnessConfig, *, timeout_s: float = 600.0) -> Path:
    """The executable of `cfg`'s npm harness, installed from the npm registry into
    `npm_root(cfg)` when missing (`npm install <package>@<version>`, into a fresh folder
    moved into place once complete). `HarnessUnavailable` says why when npm or the registry
    cannot be reached."""
    package, binary = NPM_PACKAGES[cfg.kind]
    root = npm_root(cfg)
    exe = root / "node_modules" / ".bin" / binary
    if exe.exists():
        return exe
    npm = shutil.which("npm")
    if npm is None:
        raise NpmUnavailable(
            f"harness.kind={cfg.kind} installs {package}@{npm_version(cfg)} with npm, which is "
            "not on PATH: install Node.js (20 or later) and npm"
        )
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    staging.chmod(0o755)  # the sandbox runs it as another user
    try:
        done = subprocess.run(
            [npm, "install", "--prefix", str(staging), "--no-audit", "--no-fund",
             "--loglevel", "error", f"{package}@{npm_version(cfg)}"],
            capture_output=True, text=True, timeout=timeout_s, check=False,
        )  # fmt: skip
        if done.returncode != 0 or not (staging / "node_modules" / ".bin" / binary).exists():
            why = (done.stderr or done.stdout).strip()[-600:]
            raise NpmUnavailable(
                f"npm install {package}@{npm_version(cfg)} failed (exit {done.returncode}; is "
                f"the npm registry reachable?): {why}"
            )
        os.replace(staging, root)
    except subprocess.TimeoutExpired:
        raise NpmUnavailable(
            f"npm install {package}@{npm_version(cfg)} took longer than {timeout_s:g}s"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return exe


def _assigns(env: dict[str, str]) -> str:
    """`env` as shell assignments before a command, each value quoted."""
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())


def claude_command(cfg: HarnessConfig, executable: str, base_url: str, api_key: str) -> str:
    """Claude Code in print mode (`-p`, its JSON result on stdout), its tools
    allowed without asking (the sandbox is the boundary), at most `step_limit` model turns,
    against the middleware (`ANTHROPIC_BASE_URL`, the rollout id as its API key), with no
    traffic but the model's."""
    env = {
        "ANTHROPIC_BASE_URL": base_url.rstrip("/"),
        "ANTHROPIC_API_KEY": api_key,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(cfg.max_tokens),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        **cfg.extra_env,
    }
    return (
        f'{_assigns(env)} {shlex.quote(executable)} -p "$(cat {WORK_DIR}/task.txt)" '
        f"--output-format json --max-turns {cfg.step_limit} "
        f"--permission-mode bypassPermissions"
    )


def codex_config(base_url: str) -> str:
    """Codex's `config.toml`: the middleware as its model provider, on the Responses API (the
    only one Codex speaks), the rollout id its key (`SIMLOOP_API_KEY`)."""
    return (
        'model_provider = "simloop"\n'
        "[model_providers.simloop]\n"
        'name = "simloop"\n'
        f"base_url = {json.dumps(base_url.rstrip('/') + '/v1')}\n"
        'env_key = "SIMLOOP_API_KEY"\n'
        'wire_api = "responses"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n"
    )


def codex_command(cfg: HarnessConfig, executable: str, api_key: str) -> str:
    """Codex non-interactively (`codex exec`, JSON events on stdout) with its config in
    `WORK_DIR/codex` (`codex_config`), its own sandbox off (the task's sandbox is the
    boundary) and no approvals asked."""
    env = {"SIMLOOP_API_KEY": api_key, **cfg.extra_env}
    home = f'CODEX_HOME="$PWD/{WORK_DIR}/codex"'  # expanded by the sandbox's shell
    return (
        f"{home} {_assigns(env)} {shlex.quote(executable)} exec --skip-git-repo-check --json "
        f"--model {shlex.quote(cfg.model)} --dangerously-bypass-approvals-and-sandbox "
        f'"$(cat {WORK_DIR}/task.txt)"'
    )


def launchers(cfg: HarnessConfig) -> list[str]:
    """Command prefixes that may start the harness inside the sandbox, in order: for
    mini-swe-agent `harness.executable` if set, else `mini`'s module run by this Python, or,
    where this Python is out of the sandbox user's reach (root's install under a private
    home), by a system Python of the same version importing this Python's packages; for
    `command`, those Pythons (the command's `{python}`)."""
    if cfg.kind == "mini-swe-agent" and cfg.executable:
        return [cfg.executable]
    if cfg.kind in NPM_PACKAGES:  # installed by `install_npm_harness`
        return [str(npm_root(cfg) / "node_modules" / ".bin" / NPM_PACKAGES[cfg.kind][1])]
    paths = sysconfig.get_paths()
    site = os.pathsep.join(dict.fromkeys([paths["purelib"], paths["platlib"]]))
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    pythons = [shlex.quote(sys.executable)]
    for folder in ("/usr/bin", "/usr/local/bin"):
        python = Path(folder) / version
        if python.exists():
            pythons.append(f"PYTHONPATH={shlex.quote(site)} {python}")
    if cfg.kind == "mini-swe-agent":
        return [f"{p} -m minisweagent.run.mini" for p in pythons]
    return pythons


async def pick_launcher(cfg: HarnessConfig, real: ShellFactory, task: Task) -> str:
    """The first of `launchers` that starts inside a sandbox of `task` (an npm harness is
    installed first, when missing)."""
    tried = []
    probe = "--help" if cfg.kind == "mini-swe-agent" else "-c 'import sys'"
    if cfg.kind in NPM_PACKAGES:
        await asyncio.to_thread(install_npm_harness, cfg)
        probe = "--version"
    for launcher in launchers(cfg):
        async with real(task) as shell:
            obs = await shell.run(f"{launcher} {probe}", timeout_s=300.0)
        if obs.exit_code == 0:
            return launcher
        tried.append(f"{launcher!r}: exit {obs.exit_code}: {obs.output.strip()[-200:]}")
    raise HarnessUnavailable(
        f"the harness ({cfg.kind}) does not start inside the sandbox (it runs as another user "
        "there): " + "; ".join(tried) + ". Install it where the sandbox can run it (e.g. "
        "python3 -m venv /opt/harness && /opt/harness/bin/pip install mini-swe-agent) and set "
        "harness.executable=/opt/harness/bin/mini"
    )


def mini_command(cfg: HarnessConfig, launcher: str) -> str:
    """The mini-swe-agent command line (its config file is written beside it, see
    `mini_config`): non-interactive, exits when the agent submits."""
    env = {
        "MSWEA_CONFIGURED": "true",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        **cfg.extra_env,
    }
    return (
        f"{_assigns(env)} {launcher} -c mini.yaml -c {WORK_DIR}/mini.yaml "
        f'-t "$(cat {WORK_DIR}/task.txt)" -y --exit-immediately --agent-class default '
        f"-o {WORK_DIR}/trajectory.json"
    )


def mini_config(cfg: HarnessConfig, base_url: str, api_key: str) -> dict[str, Any]:
    return {
        "agent": {"step_limit": cfg.step_limit, "cost_limit": 0},
        "model": {
            "model_name": f"openai/{cfg.model}",
            "model_kwargs": {
                "api_base": f"{base_url.rstrip('/')}/v1",
                "api_key": api_key,
                "max_tokens": cfg.max_tokens,
                "temperature": cfg.temperature,
            },
            "cost_tracking": "ignore_errors",
        },
    }


class HarnessRunner:
    """Runs harness rollouts against a middleware at `middleware_url`, finishing them through
    its admin listener (`admin`)."""

    def __init__(
        self,
        cfg: HarnessConfig,
        real: ShellFactory,
        middleware_url: str,
        launcher: str = "",
        *,
        admin: AdminAccess,
    ):
        """`launcher`: how the sandbox starts mini-swe-agent (`pick_launcher`)."""
        self.cfg, self.real, self.url = cfg, real, middleware_url.rstrip("/")
        self.admin = admin
        self.launcher = launcher or launchers(cfg)[0]
        self._slots = asyncio.Semaphore(cfg.concurrency)

    async def run_group(self, task: Task, group: str, n: int) -> list[HarnessResult]:
        """`n` rollouts of one task, concurrently (within `concurrency`)."""
        return list(await asyncio.gather(*(self.run_one(task, group, i) for i in range(n))))

    async def run_one(self, task: Task, group: str = "g0", index: int = 0) -> HarnessResult:
        async with self._slots:
            return await self._run(task, group, index)

    async def _run(self, task: Task, group: str, index: int) -> HarnessResult:
        cfg = self.cfg
        rid = rollout_id_for(task, group, index)
        base = cfg.base_url or self.url
        started = time.perf_counter()
        status, reason, exit_code, diff = "ok", None, None, ""
        try:
            async with self.real(task) as shell:
                for cmd in self._prepare(task, base, rid):
                    obs = await shell.run(cmd, timeout_s=60.0)
                    if obs.exit_code != 0:
                        raise RuntimeError(f"preparing the sandbox failed: {obs.output[-300:]}")
                command = (
                    mini_command(cfg, self.launcher)
                    if cfg.kind == "mini-swe-agent"
                    else claude_command(cfg, self.launcher, base, rid)
                    if cfg.kind == "claude-code"
                    else codex_command(cfg, self.launcher, rid)
                    if cfg.kind == "codex"
                    else cfg.command.format(
                        base_url=base,
                        api_key=rid,
                        python=self.launcher,
                        task_file=f"{WORK_DIR}/task.txt",
                    )
                )
                obs = await shell.run(command, timeout_s=cfg.wall_s)
                exit_code = obs.exit_code
                if obs.info.get("timeout"):
                    status = "truncated"
                    reason = f"the harness ran past wall_s={cfg.wall_s:g}s and was killed"
                elif exit_code != 0:
                    status = "error"
                    reason = f"the harness exited {exit_code}: {obs.output.strip()[-300:]}"
                got = await shell.run("git add -A && git diff --cached --binary HEAD", 60.0)
                if status == "error":
                    pass
                elif got.exit_code != 0 or got.truncated:
                    why = (
                        "was cut (larger than the shell's output cap)"
                        if got.truncated
                        else (f"failed: {got.output[-200:]}")
                    )
                    status, reason = "error", f"capturing the diff {why}"
                else:
                    diff = got.output
        except Exception as e:  # noqa: BLE001 - the rollout ends `error`, the run goes on
            status, reason = "error", f"{type(e).__name__}: {e}"
            log.warning("rollout %s (task %s) failed: %s", rid, task.id, reason)
        reward, grade = None, None
        if status in ("ok", "truncated"):
            reward, grade = await self._grade(task, diff)
        wall = time.perf_counter() - started
        meta = {
            "harness": cfg.kind,
            "exit_code": exit_code,
            "wall_s": round(wall, 3),
            "diff_bytes": len(diff.encode()),
        }
        if grade:  # what decided the reward, e.g. swe_bench's per-test results
            meta["grade"] = grade
        if status == "ok":
            finish_status, finish_reason = "ok", None
        else:
            finish_status, finish_reason = status, reason
        try:
            given = reward if reward is not None else 0.0
            finish = await self._finish(
                rid, given, finish_status, finish_reason, task.id, group, meta
            )
        except Exception as e:  # noqa: BLE001 - the middleware writes it `aborted`; run goes on
            log.error(
                "rollout %s: finishing it with reward %s failed, so its trajectories are "
                "not written with that grade (the middleware writes them aborted after "
                "rollout_ttl_s): %s",
                rid,
                reward,
                e,
            )
            finish = {"trajectories": 0, "segments": [], "error": f"{type(e).__name__}: {e}"}
        return HarnessResult(
            rid, task.id, group, reward, status, reason, exit_code, wall, diff, finish
        )

    def _prepare(self, task: Task, base: str, rid: str) -> list[str]:
        cmds = [
            f"mkdir -p {WORK_DIR}",
            f"if [ -d .git ]; then echo '{WORK_DIR}/' >> .git/info/exclude; fi",
        ]
        cmds += upload_commands(task.instruction, f"{WORK_DIR}/task.txt")
        if self.cfg.kind == "mini-swe-agent":
            config = json.dumps(mini_config(self.cfg, base, rid))  # JSON is YAML
            cmds += upload_commands(config, f"{WORK_DIR}/mini.yaml")
        if self.cfg.kind == "codex":
            cmds += [f"mkdir -p {WORK_DIR}/codex"]
            cmds += upload_commands(codex_config(base), f"{WORK_DIR}/codex/config.toml")
        return cmds

    async def _grade(self, task: Task, diff: str) -> tuple[float, dict]:
        """The task's reward for `diff`, computed in a fresh sandbox, and what decided it."""
        fn = get_reward(task.reward.name)
        ctx = RewardContext(
            shell_factory=lambda setup: self.real(_with_setup(task, setup)),
            timeout_s=self.cfg.grade_timeout_s,
        )
        try:
            out = await fn(task, diff, ctx)
        except Exception as e:  # noqa: BLE001 - an ungradable diff earns nothing
            log.warning("grading task %s failed: %s", task.id, e)
            return 0.0, {"error": f"{type(e).__name__}: {e}"[:500]}
        return (out.reward, dict(out.details)) if isinstance(out, Grade) else (float(out), {})

    async def _finish(
        self,
        rid: str,
        reward: float,
        status: str,
        reason: str | None,
        task_id: str,
        group: str,
        meta: dict,
    ) -> dict:
        body = {
            "reward": reward,
            "status": status,
            "task_id": task_id,
            "group_id": group,
            "meta": meta,
        }
        if reason:
            body["reason"] = reason
        async with self.admin.session(self.cfg.finish_timeout_s) as http:
            async with http.post(f"{self.admin.base}/rollouts/{rid}/finish", json=body) as r:
                answer = await r.json(content_type=None)
                if r.status == 404:  # no turn of it was recorded: nothing to write
                    return {"trajectories": 0, "segments": [], "note": answer}
                if r.status != 200:  # 401: not our token; 409: written already (aborted)
                    raise RuntimeError(f"finishing rollout {rid} failed ({r.status}): {answer}")
                return answer


def _with_setup(task: Task, setup) -> Task:
    """`task` with another setup (what a reward's shell factory is asked for)."""
    import dataclasses

    return dataclasses.replace(task, setup=setup)


class HarnessSource:
    """Harness rollouts as the RL trainer's episode source (`rl.train.rollouts.EpisodeSource`),
    asynchronous under `max_staleness` as `RolloutBuffer` runs every other arm.

    `start(version)` runs the task stream in the background: each group (`group_size`
    rollouts of one task) starts when admission (`AdmissionController`: `groups x group_size`
    rollouts per version) has room for it, so with S = 0 a batch's rollouts start only once the
    trainer has published the version that trains them, and with S > 0 up to S batches run
    ahead. A finished group's trajectories (the middleware's sink calls `collect`) are queued
    whole, stamped with their admitted version. `next_batch()` takes `groups` finished groups
    in the order they finished; a group admitted more than S versions before the source's
    version is not trained (`stale` exclusion, counted in `dropped_stale`) and its places go
    to fresh rollouts.

    A rollout may have split into several segments. A batch's segments go in `rows` rows of
    `seq_len` positions, several segments of one rollout per row where they fit
    (`rl.data.packing.pack_rows`); only what still does not fit is excluded (`over_rows`:
    the earliest segments of the rollouts with the most; on disk, not trained), counted in
    `dropped_segments` and logged with the settings that would have fitted it."""

    def __init__(
        self,
        runner: HarnessRunner,
        tasks: list[Task],
        *,
        group_size: int,
        groups: int,
        rows: int,
        seq_len: int,
        steps: int,
        max_staleness: int,
        seed: int,
    ) -> None:
        from rl.orchestrator.admission import AdmissionController
        from rl.orchestrator.buffer import task_stream

        if max_staleness is None or max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness!r} is invalid: an integer >= 0")
        self.runner, self.group_size, self.groups = runner, group_size, groups
        self.rows, self.seq_len, self.max_staleness = rows, seq_len, max_staleness
        # Every step's groups, plus (S > 0) what may start early and what replaces stale ones.
        extra = max_staleness + 1 if max_staleness else 0
        self._tasks = task_stream(tasks, groups * (max(steps, 1) + extra), seed)
        self._wanted = groups * max(steps, 1)  # groups the steps train
        self._pending = 0  # started, not yet taken into a batch or dropped
        self._taken = 0
        self._room = asyncio.Condition()
        self.admission = AdmissionController(groups * group_size, max_staleness)
        self._collected: dict[str, list] = {}
        self._done: asyncio.Queue = asyncio.Queue()
        self._feed: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()
        self.results: list[HarnessResult] = []
        self.dropped_segments = 0
        self.dropped_stale = 0

    @property
    def version(self) -> int:
        return self.admission.version

    def collect(self, trajectories: list) -> None:
        """The middleware's sink: a finished rollout's trajectories."""
        for t in trajectories:
            self._collected.setdefault(t.rollout_id, []).append(t)

    async def start(self, version: int) -> None:
        """Start rolling out under policy `version` (the one the agent server serves now)."""
        self.admission.rebase(version)
        self._feed = asyncio.create_task(self._run_stream(), name="harness-source")

    async def _run_stream(self) -> None:
        for n, task in enumerate(self._tasks):
            # Never more groups than the steps still train (a stale one frees its place).
            async with self._room:
                await self._room.wait_for(lambda: self._taken + self._pending < self._wanted)
                self._pending += 1
            admitted = await self.admission.admit(self.group_size)
            group = asyncio.create_task(
                self._group(task, f"g{n}v{admitted}", admitted), name=f"harness-group-{n}"
            )
            self._running.add(group)
            group.add_done_callback(self._running.discard)

    async def _group(self, task: Task, group: str, admitted: int) -> None:
        try:
            results = await self.runner.run_group(task, group, self.group_size)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - surfaces from next_batch, never lost
            self._done.put_nowait(e)
            return
        trajectories = [t for r in results for t in self._collected.pop(r.rollout_id, [])]
        for t in trajectories:
            t.admitted_version = admitted
        self.results += results
        self._done.put_nowait((admitted, results, trajectories))

    async def _next_group(self):
        while True:
            if not self._done.empty():
                item = self._done.get_nowait()
                if isinstance(item, BaseException):
                    raise RuntimeError(f"a harness group failed: {item}") from item
                return item
            if self._feed.done():
                self._feed.result()  # the stream's own exception, if any
                if not self._running:
                    raise RuntimeError(
                        "harness rollouts ended after delivering every planned group: more "
                        "steps than tasks planned"
                    )
            get = asyncio.ensure_future(self._done.get())
            waits = {get, *self._running, *([] if self._feed.done() else [self._feed])}
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if get in done:
                self._done.put_nowait(get.result())  # handled at the top of the loop
            else:
                get.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await get

    async def next_batch(self) -> list:
        if self._feed is None:
            raise RuntimeError("HarnessSource.start() was not called")
        trajectories: list = []
        taken = 0
        while taken < self.groups:
            admitted, results, group = await self._next_group()
            worst = self.admission.version - admitted
            if worst > self.max_staleness:
                stale = stale_exclusion(worst, self.admission.version, self.max_staleness)
                for t in group:
                    t.exclusion = t.exclusion or stale
                for _ in results:
                    await self.admission.release()
                self.dropped_stale += len(results)
                await self._settle(taken=False)
                log.info(
                    "harness source: dropped a group of %d rollouts admitted %d versions ago "
                    "(max_staleness=%d)",
                    len(results),
                    worst,
                    self.max_staleness,
                )
                continue
            trajectories += group
            taken += 1
            await self._settle(taken=True)
        dropped = fit_rows(trajectories, self.rows, self.seq_len)
        if dropped:
            log.warning(
                "harness source: %d segments of this batch do not fit its %d rows of %d "
                "tokens even packed, and are not trained (over_rows); more rows "
                "(orchestrator.batch_size) or a longer train_agent.seq_len would fit them",
                dropped,
                self.rows,
                self.seq_len,
            )
        self.dropped_segments += dropped
        return trajectories

    async def _settle(self, *, taken: bool) -> None:
        """A finished group left the queue: into a batch (`taken`) or dropped as stale."""
        async with self._room:
            self._pending -= 1
            self._taken += taken
            self._room.notify_all()

    async def set_version(self, version: int) -> None:
        await self.admission.set_version(version)

    async def close(self) -> None:
        """Cancel the stream and the rollouts still running (their sandboxes are killed; the
        middleware writes what they sent `aborted` once no grade comes)."""
        pending = [t for t in (self._feed, *self._running) if t is not None and not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=CLOSE_GRACE_S)
        if self._collected:
            late = sum(len(v) for v in self._collected.values())
            log.info(
                "harness source: %d segments were written outside any trained group (%s)",
                late,
                ", ".join(sorted(self._collected))[:300],
            )
        self._collected.clear()


def fit_rows(trajectories: list, rows: int, seq_len: int) -> int:
    """Exclude segments (`over_rows`) until the trainable ones fit `rows` rows of `seq_len`
    (`pack_rows`: several segments of a rollout per row): each time the earliest remaining
    segment of the rollout with the most. Returns how many were excluded."""
    from rl.data.packing import pack_rows

    live: dict[str, list] = {}
    for t in trajectories:
        if t.exclusion is None:
            live.setdefault(t.rollout_id or str(id(t)), []).append(t)
    marked = 0
    while pack_rows([t for v in live.values() for t in v], rows=rows, seq_len=seq_len) is None:
        longest = max(live.values(), key=len)
        victim = longest.pop(0)
        victim.exclusion = Exclusion(
            "over_rows",
            f"the batch's segments did not fit its {rows} rows of {seq_len} tokens, packed",
        )
        marked += 1
    return marked
