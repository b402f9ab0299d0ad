"""E2BShell and sweep against a fake e2b SDK with the real SDK's signatures and exceptions; one
live test when E2B_API_KEY is set.

The fake cloud understands a few commands: `echo X`, `exit N` (non-zero exits raise
CommandExitException as the SDK does), `sleep S` (TimeoutException past the command timeout),
`hang` (never answers, ignoring every timeout), `gone` (the sandbox died), and `mkdir -p`.
"""

import asyncio
import inspect
import itertools
import logging
import os
import time
from datetime import UTC, datetime, timedelta

import e2b as err
import pytest
from e2b import AsyncSandbox, AsyncSandboxPaginator, CommandResult
from e2b.sandbox_async.commands.command import Commands
from e2b.sandbox_async.filesystem.filesystem import Filesystem

from envs.config import E2BConfig
from envs.e2b import EPISODE_TAG, RUN_TAG, E2BLimits, E2BShell, RateLimiter, shared_limits, sweep
from envs.shell import ShellError, TaskSetup, TaskSetupError

# ---------------------------------------------------------------------------------------------
# The fake SDK


class FakeCloud:
    """State behind the fake SDK: sandboxes, call records and injected failures."""

    def __init__(self, create_delay_s: float = 0.0):
        self.create_delay_s = create_delay_s
        self.sandboxes: dict[str, FakeSandboxBase] = {}
        self.by_key: dict[str, FakeSandboxBase] = {}
        self.create_times: list[float] = []
        self.create_calls: list[dict] = []
        self.killed: list[str] = []
        self.max_live = 0
        self.refuse_creations: list[BaseException] = []
        self.fail_uploads: list[BaseException] = []
        self.run_calls: list[dict] = []
        self._ids = itertools.count()

    @property
    def live(self) -> list[str]:
        return sorted(self.sandboxes)

    def add(self, metadata: dict, started_at: datetime | None = None) -> "FakeSandboxBase":
        sb = self.sdk()(f"sbx-{next(self._ids)}", metadata, started_at or datetime.now(UTC))
        self.sandboxes[sb.sandbox_id] = sb
        self.max_live = max(self.max_live, len(self.sandboxes))
        return sb

    def kill(self, sandbox_id: str) -> bool:
        if self.sandboxes.pop(sandbox_id, None) is None:
            return False
        self.killed.append(sandbox_id)
        return True

    def sdk(self) -> type:
        return type("FakeAsyncSandbox", (FakeSandboxBase,), {"cloud": self})


class FakeCommands:
    def __init__(self, sandbox: "FakeSandboxBase"):
        self.sandbox = sandbox

    async def run(
        self,
        cmd,
        background=None,
        envs=None,
        user=None,
        cwd=None,
        on_stdout=None,
        on_stderr=None,
        stdin=None,
        timeout=60,
        request_timeout=None,
        *,
        retain_output=True,
    ):
        cloud = self.sandbox.cloud
        cloud.run_calls.append({"cmd": cmd, "cwd": cwd, "user": user, "timeout": timeout})
        if self.sandbox.sandbox_id not in cloud.sandboxes or cmd == "gone":
            raise err.SandboxNotRunningException("sandbox was not found")
        if cmd == "unreachable":
            raise err.SandboxUnreachableException("port is not open")
        if cmd == "hang":
            await asyncio.sleep(3600)
        word, _, arg = cmd.partition(" ")
        if word == "sleep":
            if float(arg) > timeout:
                await asyncio.sleep(timeout)
                raise err.TimeoutException("context deadline exceeded: deadline_exceeded")
            await asyncio.sleep(float(arg))
            return CommandResult(stdout="", stderr="", exit_code=0, error=None)
        if word == "exit":
            raise err.CommandExitException(
                stderr=f"failing with {arg}\n", stdout="partial\n", exit_code=int(arg), error=None
            )
        if word == "echo":
            return CommandResult(stdout=arg + "\n", stderr="", exit_code=0, error=None)
        if word == "cat":
            text = self.sandbox.files.contents[arg]
            return CommandResult(stdout=text, stderr="", exit_code=0, error=None)
        return CommandResult(stdout="", stderr="", exit_code=0, error=None)


class FakeFiles:
    def __init__(self, sandbox: "FakeSandboxBase"):
        self.sandbox = sandbox
        self.contents: dict[str, str] = {}

    async def write(
        self,
        path,
        data,
        user=None,
        request_timeout=None,
        gzip=False,
        use_octet_stream=None,
        metadata=None,
    ):
        if self.sandbox.cloud.fail_uploads:
            raise self.sandbox.cloud.fail_uploads.pop(0)
        self.contents[path] = data


class FakePaginator:
    def __init__(self, items: list, limit: int):
        self._items, self._limit = items, limit
        self.has_next = True

    async def next_items(self, **opts):
        page, self._items = self._items[: self._limit], self._items[self._limit :]
        self.has_next = bool(self._items)
        return page


class _KillDescriptor:
    """Like the SDK's class_method_variant: `sb.kill()` and `Sandbox.kill(sandbox_id)`."""

    def __get__(self, obj, cls):
        if obj is None:

            async def kill_by_id(sandbox_id, **opts):
                return cls.cloud.kill(sandbox_id)

            return kill_by_id

        async def kill(**opts):
            return cls.cloud.kill(obj.sandbox_id)

        return kill


class FakeSandboxBase:
    cloud: FakeCloud
    kill = _KillDescriptor()

    def __init__(self, sandbox_id: str, metadata: dict, started_at: datetime):
        self.sandbox_id = sandbox_id
        self.metadata = metadata
        self.started_at = started_at
        self.commands = FakeCommands(self)
        self.files = FakeFiles(self)

    @classmethod
    async def create(
        cls,
        template=None,
        timeout=None,
        metadata=None,
        envs=None,
        secure=None,
        allow_internet_access=None,
        mcp=None,
        network=None,
        iam=None,
        lifecycle=None,
        volume_mounts=None,
        logger=None,
        idempotency_key=None,
        **opts,
    ):
        cloud = cls.cloud
        cloud.create_calls.append(
            {"template": template, "timeout": timeout, "metadata": metadata, "key": idempotency_key}
        )
        cloud.create_times.append(time.monotonic())
        if cloud.refuse_creations:
            raise cloud.refuse_creations.pop(0)
        await asyncio.sleep(cloud.create_delay_s)
        if idempotency_key in cloud.by_key:
            return cloud.by_key[idempotency_key]
        sb = cloud.add(dict(metadata or {}))
        sb.template, sb.lifetime = template, timeout
        cloud.by_key[idempotency_key] = sb
        return sb

    @classmethod
    def list(cls, query=None, limit=None, next_token=None, order=None, **opts):
        items = []
        for sb in cls.cloud.sandboxes.values():
            wanted = (query.metadata or {}) if query is not None else {}
            if all(sb.metadata.get(k) == v for k, v in wanted.items()):
                items.append(sb)
        return FakePaginator(items, limit or 100)


# ---------------------------------------------------------------------------------------------


def make_shell(cloud: FakeCloud, cfg: E2BConfig | None = None, **kwargs) -> E2BShell:
    kwargs.setdefault("run_id", "run-1")
    kwargs.setdefault("episode_id", f"ep-{len(cloud.create_calls)}")
    return E2BShell(cfg or E2BConfig(backoff_s=0.001), sdk=cloud.sdk(), api_key="test", **kwargs)


def test_fake_mirrors_the_sdk_signatures():
    pairs = [
        (FakeSandboxBase.create, AsyncSandbox.create),
        (FakeSandboxBase.list, AsyncSandbox.list),
        (FakeCommands.run, Commands.run),
        (FakeFiles.write, Filesystem.write),
        (FakePaginator.next_items, AsyncSandboxPaginator.next_items),
    ]
    for fake, real in pairs:
        assert list(inspect.signature(fake).parameters) == list(
            inspect.signature(real).parameters
        ), real.__qualname__
    assert inspect.signature(Commands.run).parameters["timeout"].default == 60
    assert issubclass(err.CommandExitException, err.SandboxException)


async def test_run_reports_output_and_nonzero_exit_code():
    cloud = FakeCloud()
    cfg = E2BConfig(template="my-template", sandbox_timeout_s=300, backoff_s=0.001)
    async with make_shell(cloud, cfg, episode_id="ep-7") as sh:
        ok = await sh.run("echo hello", timeout_s=7)
        bad = await sh.run("exit 3", timeout_s=7)
        sid = sh.sandbox_id
    assert (ok.output, ok.exit_code) == ("hello\n", 0)
    assert bad.exit_code == 3 and bad.output == "partial\nfailing with 3\n"
    call = cloud.create_calls[0]
    assert call["template"] == "my-template" and call["timeout"] == 300
    assert call["metadata"] == {RUN_TAG: "run-1", EPISODE_TAG: "ep-7"}
    run = cloud.run_calls[-1]
    assert run["timeout"] == 7 and run["cwd"] == cfg.workdir and run["user"] == cfg.user
    assert cloud.killed == [sid] and cloud.live == []


async def test_setup_uploads_files_with_retries_and_runs_commands():
    cloud = FakeCloud()
    cloud.fail_uploads = [err.TimeoutException("canceled"), err.RateLimitException("429")]
    setup = TaskSetup(files={"src/a.py": "print(1)\n"}, commands=("echo ready",))
    async with make_shell(cloud, setup=setup) as sh:
        obs = await sh.run("cat /home/user/workspace/src/a.py", 5)
    assert obs.output == "print(1)\n"
    assert [c["cmd"] for c in cloud.run_calls][:2] == [
        "mkdir -p '/home/user/workspace'",
        "echo ready",
    ]


async def test_sdk_timeout_becomes_an_observation_with_reason():
    cloud = FakeCloud()
    async with make_shell(cloud) as sh:
        obs = await sh.run("sleep 5", timeout_s=0.05)
        after = await sh.run("echo still-usable", timeout_s=1)
    assert obs.exit_code == 124 and obs.info["timeout"] is True
    assert "timed out after 0.05s" in obs.info["reason"]
    assert "TimeoutException" in obs.info["reason"]
    assert after.output == "still-usable\n"


async def test_unanswered_request_is_bounded_and_explained():
    cloud = FakeCloud()
    cfg = E2BConfig(request_timeout_s=0.2, backoff_s=0.001)
    t0 = time.monotonic()
    async with make_shell(cloud, cfg) as sh:
        obs = await sh.run("hang", timeout_s=0.1)
    assert time.monotonic() - t0 < 2
    assert obs.exit_code == 124 and "no answer from e2b within 0.3s" in obs.info["reason"]


async def test_commands_are_never_retried():
    cloud = FakeCloud()
    async with make_shell(cloud) as sh:
        with pytest.raises(ShellError, match="gone or unreachable"):
            await sh.run("unreachable", timeout_s=1)
    assert [c["cmd"] for c in cloud.run_calls].count("unreachable") == 1
    assert cloud.live == []


async def test_creation_retries_refusals_with_one_idempotency_key():
    cloud = FakeCloud()
    cloud.refuse_creations = [err.RateLimitException("slow down"), err.ServiceBusyException("503")]
    async with make_shell(cloud) as sh:
        await sh.run("echo x", 1)
    keys = {c["key"] for c in cloud.create_calls}
    assert len(cloud.create_calls) == 3 and len(keys) == 1 and cloud.killed and cloud.live == []


async def test_retries_are_logged_then_give_up_naming_the_attempts(caplog):
    cloud = FakeCloud()
    cloud.fail_uploads = [err.RateLimitException("429")] * 3
    cfg = E2BConfig(retries=2, backoff_s=0.001)
    with caplog.at_level(logging.WARNING, logger="envs.e2b"):
        with pytest.raises(ShellError, match=r"upload a.txt failed after 3 attempts: RateLimit"):
            async with make_shell(cloud, cfg, setup=TaskSetup(files={"a.txt": "x"})):
                pass
    assert [r.getMessage() for r in caplog.records] == [
        f"e2b upload a.txt failed (RateLimitException('429')); retry {n} in 0.00s" for n in (1, 2)
    ]
    assert cloud.live == [] and cloud.fail_uploads == []


async def test_a_gone_sandbox_is_not_retried():
    cloud = FakeCloud()
    # SandboxNotRunningException subclasses the SDK's (retried) TimeoutException.
    cloud.fail_uploads = [err.SandboxNotRunningException("gone"), err.RateLimitException("x")]
    with pytest.raises(ShellError, match=r"upload a.txt: the sandbox is gone"):
        async with make_shell(cloud, setup=TaskSetup(files={"a.txt": "x"})):
            pass
    assert len(cloud.fail_uploads) == 1


async def test_creation_gives_up_after_the_retries_without_logging(caplog):
    cloud = FakeCloud()
    cloud.refuse_creations = [err.ServiceBusyException("503")] * 3
    with caplog.at_level(logging.WARNING, logger="envs.e2b"):
        with pytest.raises(ShellError, match=r"sandbox creation failed after 3 attempts"):
            async with make_shell(cloud, E2BConfig(retries=2, backoff_s=0.001)):
                pass
    assert len(cloud.create_calls) == 3 and not caplog.records


async def test_creation_does_not_retry_other_errors_and_frees_the_slot():
    cloud = FakeCloud()
    cloud.refuse_creations = [err.AuthenticationException("bad key")]
    limits = E2BLimits(100.0, 2)
    with pytest.raises(err.AuthenticationException):
        async with make_shell(cloud, limits=limits):
            pass
    assert len(cloud.create_calls) == 1
    assert limits.slots._value == 2  # the slot came back (no public counter)


async def run_and_exit(path: str, cloud: FakeCloud, limits: E2BLimits) -> None:
    setup = TaskSetup(commands=("exit 2",)) if path == "setup_fails" else None
    sh = make_shell(cloud, limits=limits, setup=setup)
    if path == "normal":
        async with sh:
            await sh.run("echo ok", 1)
    elif path == "body_raises":
        with pytest.raises(ZeroDivisionError):
            async with sh:
                1 / 0  # noqa: B018
    elif path == "command_timeout":
        async with sh:
            assert (await sh.run("sleep 9", 0.01)).exit_code == 124
    elif path == "sandbox_gone":
        with pytest.raises(ShellError, match="gone"):
            async with sh:
                await sh.run("gone", 1)
    elif path == "setup_fails":
        with pytest.raises(TaskSetupError, match="exited 2"):
            async with sh:
                pass
    elif path == "cancelled":

        async def episode():
            async with sh:
                await sh.run("hang", 30)

        task = asyncio.create_task(episode(), name="e2b-cancelled-episode")
        while not cloud.run_calls or cloud.run_calls[-1]["cmd"] != "hang":
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.01)  # the shielded kill finishes in the background


@pytest.mark.parametrize(
    "path",
    ["normal", "body_raises", "command_timeout", "sandbox_gone", "setup_fails", "cancelled"],
)
async def test_sandbox_is_killed_on_every_exit_path(path):
    cloud = FakeCloud()
    limits = E2BLimits(1000.0, 3)
    await run_and_exit(path, cloud, limits)
    assert len(cloud.create_calls) == 1
    created = next(iter(cloud.by_key.values())).sandbox_id
    # "gone" means the cloud already lost it; every other path must kill it.
    assert cloud.live == []
    assert created in cloud.killed or path == "sandbox_gone"
    assert limits.slots._value == 3  # every slot came back


async def test_rate_limit_holds_under_50_concurrent_creations():
    cloud = FakeCloud(create_delay_s=0.01)
    rate = 100.0
    cfg = E2BConfig(creation_rate_per_s=rate, max_concurrent=100, backoff_s=0.001)

    async def episode(i: int):
        async with make_shell(cloud, cfg, episode_id=f"ep-{i}") as sh:  # shared default limits
            return (await sh.run(f"echo {i}", 1)).output

    outputs = await asyncio.gather(*(episode(i) for i in range(50)))
    assert outputs == [f"{i}\n" for i in range(50)]
    times = sorted(cloud.create_times)
    assert len(times) == 50
    # Creations are spaced 1/rate apart; a late wake-up (a busy shared machine) may bunch two,
    # so the check allows 50 ms of scheduling slack over a 0.25 s window.
    window = 25
    for a, b in zip(times, times[window:], strict=False):
        assert b - a >= window / rate - 0.05
    assert times[-1] - times[0] >= 49 / rate - 0.05
    assert shared_limits(cfg) is shared_limits(cfg)
    assert cloud.live == []


async def test_concurrency_cap_is_shared_by_all_episodes():
    cloud = FakeCloud()
    cfg = E2BConfig(creation_rate_per_s=1000, max_concurrent=4, backoff_s=0.001)
    limits = E2BLimits(cfg.creation_rate_per_s, cfg.max_concurrent)

    async def episode(i: int):
        async with make_shell(cloud, cfg, limits=limits, episode_id=f"ep-{i}") as sh:
            await sh.run("sleep 0.02", 1)

    await asyncio.gather(*(episode(i) for i in range(20)))
    assert cloud.max_live == 4 and len(cloud.killed) == 20 and cloud.live == []


async def test_rate_limiter_spaces_acquisitions():
    limiter = RateLimiter(200.0)
    t0 = time.monotonic()
    await asyncio.gather(*(limiter.acquire() for _ in range(21)))
    assert time.monotonic() - t0 >= 20 / 200.0 - 0.005


async def test_sweep_kills_orphans_found_by_metadata():
    cloud = FakeCloud()
    for _ in range(105):  # more than one page
        cloud.add({RUN_TAG: "r1", EPISODE_TAG: "e"})
    old = cloud.add({RUN_TAG: "r2"}, started_at=datetime.now(UTC) - timedelta(hours=2))
    young = cloud.add({RUN_TAG: "r2"})
    stranger = cloud.add({"owner": "someone-else"})
    killed = await sweep("r1", sdk=cloud.sdk(), api_key="test")
    assert len(killed) == 105 and set(cloud.live) == {
        old.sandbox_id,
        young.sandbox_id,
        stranger.sandbox_id,
    }
    assert await sweep(None, sdk=cloud.sdk(), older_than_s=3600, api_key="t") == [old.sandbox_id]
    assert await sweep(None, sdk=cloud.sdk(), api_key="t") == [young.sandbox_id]
    assert cloud.live == [stranger.sandbox_id]


def test_config_validation():
    with pytest.raises(ValueError, match=r"E2BConfig.max_concurrent=0 is invalid"):
        E2BConfig(max_concurrent=0)
    with pytest.raises(ValueError, match=r"E2BConfig.workdir='rel' is invalid: an absolute"):
        E2BConfig(workdir="rel")


@pytest.mark.skipif(not os.environ.get("E2B_API_KEY"), reason="E2B_API_KEY is not set")
async def test_live_e2b_sandbox():
    cfg = E2BConfig(sandbox_timeout_s=120)
    setup = TaskSetup(files={"hello.txt": "hi from simloop\n"})
    run_id = f"simloop-test-{os.getpid()}"
    async with E2BShell(cfg, run_id=run_id, episode_id="live", setup=setup) as sh:
        ok = await sh.run("cat hello.txt && pwd", timeout_s=30)
        bad = await sh.run("echo oops >&2; exit 4", timeout_s=30)
        slow = await sh.run("sleep 30", timeout_s=2)
    assert ok.exit_code == 0 and ok.output.startswith("hi from simloop\n")
    assert bad.exit_code == 4 and "oops" in bad.output
    assert slow.exit_code == 124 and slow.info["timeout"]
    assert await sweep(run_id) == []
