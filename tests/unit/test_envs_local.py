"""LocalShell against hostile commands: each test bounds time, memory and leftovers.

Process containment is tested with a bounded flood of `sleep &`, never an exponential fork bomb:
tests share the machine. Each sleep uses a unique duration so the test can find exactly its own
processes in /proc.
"""

import asyncio
import os
import pwd
import random
import time
from pathlib import Path

import pytest

import envs.local as local_mod
from envs.config import LocalShellConfig
from envs.local import Isolation, LocalShell, detect_isolation
from envs.shell import HeadTailBuffer, TaskSetup, TaskSetupError
from tests.fakes import wait_until

IS_ROOT = os.geteuid() == 0
COMMAND_USER = LocalShellConfig().user  # as root, LocalShell runs commands as this account


def _command_ids() -> tuple[int, int] | None:
    """(uid, gid) that commands run as, looked up as `detect_isolation` does: the account
    `COMMAND_USER` when root (None where it does not exist), else our own."""
    if not IS_ROOT:
        return os.getuid(), os.getgid()
    try:
        pw = pwd.getpwnam(COMMAND_USER)
    except KeyError:
        return None
    return pw.pw_uid, pw.pw_gid


COMMAND_IDS = _command_ids()
# As root, a LocalShell with the default config refuses to start without that account.
needs_command_user = pytest.mark.skipif(
    COMMAND_IDS is None,
    reason=f"running as root, and this machine has no {COMMAND_USER!r} account for LocalShell "
    f"to drop to (LocalShellConfig.user); create it, or run the tests as a normal user",
)


def procs_running(argv: list[str]) -> list[int]:
    """Pids whose command line is exactly `argv`."""
    want = "\0".join(argv).encode() + b"\0"
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if Path(entry.path, "cmdline").read_bytes() == want:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


@needs_command_user
async def test_runs_with_no_arguments_and_cleans_up():
    async with LocalShell() as sh:
        obs = await sh.run("echo hi", timeout_s=5)
        workspace = sh.workspace
        assert workspace.is_dir()
    assert (obs.output, obs.exit_code, obs.truncated) == ("hi\n", 0, False)
    assert obs.duration_s < 5 and "isolation" in obs.info
    assert not workspace.exists() and not workspace.parent.exists()


@needs_command_user
async def test_fresh_bash_per_command_state_only_in_files():
    async with LocalShell() as sh:
        first = await sh.run("export FOO=bar; echo kept > note.txt; cd /; echo err >&2; exit 3", 5)
        second = await sh.run('pwd; echo "foo=$FOO"; cat note.txt', 5)
        workspace = str(sh.workdir)
    assert first.exit_code == 3 and first.output == "err\n"
    assert second.output == f"{workspace}\nfoo=\nkept\n"


@needs_command_user
async def test_setup_files_and_commands_usable_by_the_command_user():
    setup = TaskSetup(files={"a/b.txt": "hello\n"}, commands=("cp a/b.txt c.txt",))
    async with LocalShell(setup=setup) as sh:
        obs = await sh.run("cat c.txt && echo more >> a/b.txt && cat a/b.txt && id -u", 5)
        uid = sh.isolation["uid"]
    assert obs.exit_code == 0, obs.output
    assert obs.output == f"hello\nhello\nmore\n{uid}\n"
    # As root, each shell has its own uid from the configured range (else the command user's).
    base = LocalShellConfig().uid_base
    assert base <= uid < base + LocalShellConfig().uid_count if IS_ROOT else uid == os.getuid()


@needs_command_user
async def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("SIMLOOP_TEST_SECRET", "hunter2-do-not-leak")
    cfg = LocalShellConfig(env={"EXTRA": "given"})
    async with LocalShell(cfg) as sh:
        obs = await sh.run("env", 5)
        home = str(sh.workdir.parent / "home")
    assert "hunter2" not in obs.output and "SIMLOOP_TEST_SECRET" not in obs.output
    assert f"HOME={home}\n" in obs.output and "EXTRA=given\n" in obs.output


@needs_command_user
async def test_sleep_1000_times_out_and_is_killed():
    t0 = time.monotonic()
    async with LocalShell() as sh:
        obs = await sh.run("echo before; sleep 987.25", timeout_s=1)
    assert time.monotonic() - t0 < 4
    assert obs.exit_code == 124 and obs.info["timeout"] is True
    assert "timed out after 1s" in obs.info["reason"] and obs.output == "before\n"
    assert procs_running(["sleep", "987.25"]) == []


@needs_command_user
@pytest.mark.parametrize("command", ["yes", "cat /dev/zero"])
async def test_infinite_output_is_capped_and_killed(command):
    cfg = LocalShellConfig(max_output_bytes=4096, kill_after_output_bytes=2**20)
    t0 = time.monotonic()
    async with LocalShell(cfg) as sh:
        obs = await sh.run(command, timeout_s=30)
    assert time.monotonic() - t0 < 10
    assert obs.truncated and obs.info["killed"] == "output_limit"
    assert obs.info["output_bytes"] > 2**20
    assert len(obs.output) < 4096 + 200  # kept halves plus the marker
    assert "truncated" in obs.output


@needs_command_user
async def test_middle_truncation_keeps_head_and_tail():
    async with LocalShell(LocalShellConfig(max_output_bytes=1000)) as sh:
        obs = await sh.run("seq 1 100000", 10)
    assert obs.exit_code == 0 and obs.truncated
    assert obs.output.startswith("1\n2\n3\n") and obs.output.endswith("99999\n100000\n")
    assert "bytes of output truncated" in obs.output


def test_head_tail_buffer_matches_reference():
    rng = random.Random(0)
    data = bytes(rng.randrange(256) for _ in range(50_000))
    buf = HeadTailBuffer(1000)
    i = 0
    while i < len(data):
        n = rng.randrange(1, 3000)
        buf.write(data[i : i + n])
        i += n
    value = buf.getvalue()
    assert buf.total == len(data) and buf.truncated
    assert value.startswith(data[:500]) and value.endswith(data[-500:])
    assert b"49000 bytes of output truncated" in value
    small = HeadTailBuffer(1000)
    small.write(data[:1000])
    assert small.getvalue() == data[:1000] and not small.truncated


@needs_command_user
async def test_binary_output_becomes_valid_text():
    async with LocalShell() as sh:
        obs = await sh.run("head -c 200000 /dev/urandom; printf '\\0\\0'", 10)
    assert obs.exit_code == 0 and obs.truncated and obs.info.get("binary") is True
    assert "\x00" not in obs.output
    obs.output.encode("utf-8")  # no lone surrogates: any tokenizer and JSON can take it


@needs_command_user
async def test_memory_is_bounded_by_address_space_limit():
    cfg = LocalShellConfig(memory_bytes=256 * 2**20)
    t0 = time.monotonic()
    async with LocalShell(cfg) as sh:
        obs = await sh.run("x=$(head -c 1500000000 /dev/zero | tr '\\0' a); echo got ${#x}", 20)
    assert time.monotonic() - t0 < 15
    assert "got 1500000000" not in obs.output
    assert obs.exit_code != 0 or "got" not in obs.output


@needs_command_user
async def test_file_size_is_bounded():
    cfg = LocalShellConfig(file_size_bytes=2**20)
    async with LocalShell(cfg) as sh:
        obs = await sh.run("head -c 10000000 /dev/zero > big.bin", 10)
        size = (sh.workspace / "big.bin").stat().st_size
    assert obs.exit_code != 0 and size <= 2**20


@pytest.mark.skipif(
    not IS_ROOT, reason=f"RLIMIT_NPROC containment is tested as root -> {COMMAND_USER}"
)
@needs_command_user
async def test_process_flood_is_contained():
    limit = 32
    argv = ["sleep", "321.125"]
    peak = 0

    async def watch():
        nonlocal peak
        while True:
            peak = max(peak, len(procs_running(argv)))
            await asyncio.sleep(0.05)

    cfg = LocalShellConfig(max_processes=limit)
    t0 = time.monotonic()
    async with LocalShell(cfg) as sh:
        watcher = asyncio.create_task(watch(), name="flood-watcher")
        try:
            obs = await sh.run("for i in $(seq 3000); do sleep 321.125 & done; echo done", 3)
        finally:
            watcher.cancel()
    assert time.monotonic() - t0 < 8
    assert 0 < peak <= limit
    assert "Resource temporarily unavailable" in obs.output
    assert procs_running(argv) == []


def fallback_isolation() -> Isolation:
    """No namespaces: containment by process group and workspace scan only."""
    uid, gid = COMMAND_IDS
    if IS_ROOT:
        drop = ("setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--")
        return Isolation(drop, False, False, COMMAND_USER, uid, gid)
    return Isolation((), False, False, "me", uid, gid)


@needs_command_user
@pytest.mark.parametrize("mode", ["detected", "fallback"])
async def test_background_children_neither_hang_nor_survive(mode, monkeypatch):
    if mode == "fallback":
        monkeypatch.setattr(local_mod, "detect_isolation", lambda user, net: fallback_isolation())
    plain, escaped = ["sleep", "654.5"], ["sleep", "654.75"]
    async with LocalShell() as sh:
        t0 = time.monotonic()
        obs = await sh.run("sleep 654.5 & setsid sleep 654.75 & echo started", timeout_s=20)
        elapsed = time.monotonic() - t0
        # Killed processes leave /proc a moment later: wait for that (a guard, not a race).
        gone = await wait_until(lambda: not procs_running(plain) + procs_running(escaped), 30)
    assert obs.exit_code == 0 and obs.output == "started\n"
    assert elapsed < 3
    assert gone, procs_running(plain) + procs_running(escaped)


@needs_command_user
async def test_no_network_where_unshare_works():
    async with LocalShell() as sh:
        iso = sh.isolation
        if not iso["network"]:
            pytest.skip("unshare -n does not work here; LocalShell records network=False")
        devices = await sh.run("cat /proc/net/dev", 5)
        obs = await sh.run("exec 3<>/dev/tcp/1.1.1.1/53 && echo connected", 10)
    interfaces = [ln.split(":")[0].strip() for ln in devices.output.splitlines() if ":" in ln]
    assert interfaces == ["lo"] and "connected" not in obs.output
    assert obs.exit_code != 0 and obs.duration_s < 5
    assert obs.info["isolation"].startswith("netns")


@needs_command_user
def test_isolation_probe_matches_this_machine():
    iso = detect_isolation(COMMAND_USER, True)
    assert (iso.uid, iso.gid) == COMMAND_IDS
    if IS_ROOT:
        assert iso.user == COMMAND_USER
    assert detect_isolation(COMMAND_USER, True) is iso  # probed once per process


@needs_command_user
async def test_workspace_removed_when_the_body_raises():
    shell = LocalShell()
    with pytest.raises(KeyError):
        async with shell:
            base = shell.workspace.parent
            await shell.run("mkdir -p d/e && touch d/e/f && chmod 000 d", 5)
            raise KeyError("boom")
    assert not base.exists()


@needs_command_user
async def test_workspace_removed_when_setup_fails(monkeypatch):
    made = []
    real_mkdtemp = local_mod.tempfile.mkdtemp

    def spy(*args, **kwargs):
        made.append(real_mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(local_mod.tempfile, "mkdtemp", spy)
    with pytest.raises(TaskSetupError, match="exited 7"):
        async with LocalShell(setup=TaskSetup(commands=("exit 7",))):
            pass
    assert len(made) == 1 and not os.path.exists(made[0])


@needs_command_user
async def test_workspace_and_command_gone_when_cancelled():
    shell = LocalShell()
    started = asyncio.Event()

    async def episode():
        async with shell:
            started.set()
            await shell.run("sleep 432.5", timeout_s=60)

    task = asyncio.create_task(episode(), name="cancelled-episode")
    await started.wait()
    base = shell.workspace.parent
    # Cancel once the command runs (else the test would prove nothing about killing it).
    assert await wait_until(lambda: procs_running(["sleep", "432.5"]) != [], timeout_s=30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not base.exists()
    # SIGKILL is delivered and reaped asynchronously: the process must be gone within seconds.
    assert await wait_until(lambda: procs_running(["sleep", "432.5"]) == [], timeout_s=10)


@needs_command_user
async def test_cancelled_while_the_command_starts_still_kills_its_group(monkeypatch):
    """A cancellation that lands while asyncio is still connecting the new process's pipes
    (seen under load: a 432 s `sleep` outlived its cancelled episode) kills the whole group."""
    loop = asyncio.get_running_loop()
    real = loop.subprocess_exec
    spawned = asyncio.Event()

    async def slow_to_connect(*args, **kwargs):
        result = await real(*args, **kwargs)
        spawned.set()
        await asyncio.sleep(1.0)  # the window in which the cancellation arrives
        return result

    monkeypatch.setattr(loop, "subprocess_exec", slow_to_connect)
    shell = LocalShell()
    await shell.start()
    try:
        task = asyncio.create_task(shell.run("sleep 431.5", timeout_s=60))
        await spawned.wait()
        assert await wait_until(lambda: procs_running(["sleep", "431.5"]) != [], timeout_s=30)
        task.cancel()
        began = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - began < 30  # the start-up window, not the command's 431 s
        assert await wait_until(lambda: procs_running(["sleep", "431.5"]) == [], timeout_s=10)
    finally:
        await shell.close()


def test_config_validation_names_field_and_value():
    with pytest.raises(ValueError, match=r"LocalShellConfig.max_processes=0 is invalid"):
        LocalShellConfig(max_processes=0)
    with pytest.raises(ValueError, match=r"kill_after_output_bytes=10 .*at least max_output"):
        LocalShellConfig(kill_after_output_bytes=10)


REMOVE_A_MOUNTPOINT = """
import os, subprocess, sys
import envs.local as local
ws = sys.argv[1]
subprocess.run(["mount", "-t", "tmpfs", "none", ws], check=True)
try:
    local._rmtree(ws)  # rmdir of a mountpoint fails (EBUSY) even for root
except OSError as e:
    print("refused", e.errno)
print(oct(os.stat(os.path.dirname(ws)).st_mode & 0o7777))
"""


def test_a_workspace_that_cannot_be_removed_never_changes_the_folder_above_it(tmp_path):
    """When removing a workspace fails at its top (here: it is a mountpoint), the directory
    holding it keeps its mode. It once became 0700, and that directory was /tmp itself."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare to mount a tmpfs in a private mount namespace")
    parent = tmp_path / "root"
    (parent / "simloop-ws-x").mkdir(parents=True)
    parent.chmod(0o1777)
    r = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            sys.executable,
            "-c",
            REMOVE_A_MOUNTPOINT,
            str(parent / "simloop-ws-x"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    if r.returncode != 0 and "mount" in r.stderr:
        pytest.skip(f"cannot mount here: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["refused", "16", "0o1777"]
    local_mod._rmtree(str(parent / "simloop-ws-x"))  # unmounted now: removed
    assert not (parent / "simloop-ws-x").exists()
    local_mod._rmtree(str(parent / "simloop-ws-x"))  # already gone: no error
