"""LocalShell isolation between episodes and from the host: own /proc (no other process's
command line, e.g. a server's admin token), private size-capped tmp folders, the other
workspaces out of reach, a uid per shell (a fork bomb exhausts only its own), commands that die
with a killed simloop, and stale workspaces of dead processes swept. Each test skips, naming
what is missing, where this kernel or account cannot provide the isolation it checks."""

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import envs.local as local_mod
import envs.local_uids as local_uids
from envs.config import LocalShellConfig
from envs.local import LocalShell, detect_isolation, sweep_stale_workspaces
from envs.local_uids import UidSlots
from envs.shell import ShellError
from launch.deploy.processes import local_server_args
from launch.jobs import serve
from tests.fakes import wait_until
from tests.unit.test_envs_local import needs_command_user, procs_running

ROOT = Path(__file__).resolve().parents[2]
IS_ROOT = os.geteuid() == 0
pytestmark = needs_command_user


def _iso() -> dict:
    iso = detect_isolation(LocalShellConfig().user, True)
    return local_mod.isolation_report(iso)


def _need(key: str, why: str) -> None:
    if not _iso()[key]:
        pytest.skip(f"LocalShell cannot provide {why} here ({key}=False on this machine)")


async def test_own_proc_hides_other_processes_and_their_secrets():
    _need("private_proc", "an own /proc (mount + PID namespaces)")
    secret = "simloop-test-secret-0f3a9"
    server = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "--admin-token", secret]
    )
    try:
        async with LocalShell() as sh:
            obs = await sh.run(
                "cat /proc/[0-9]*/cmdline | tr '\\0' ' '; echo; ls /proc | grep -c '^[0-9]'", 5
            )
        assert obs.exit_code == 0, obs.output
        assert secret not in obs.output and "time.sleep" not in obs.output
        assert int(obs.output.split()[-1]) < 10  # only the command's own processes
    finally:
        server.kill()
        server.wait()


async def test_episodes_cannot_reach_each_other_or_leftovers():
    _need("workspaces_hidden", "hidden workspaces (a mount namespace)")
    root = Path(LocalShellConfig().workspace_root or "/tmp")
    leftover = root / f"simloop-ws-leftover-{os.getpid()}"  # an old run's, readable by all
    leftover.mkdir(mode=0o755)
    (leftover / "answer.txt").write_text("leaked")
    leftover.chmod(0o755)
    try:
        async with LocalShell() as a, LocalShell() as b:
            await a.run("echo mine > secret.txt", 5)
            victim, files = a.workdir, a.workspace  # as commands name it, as we reach it
            obs = await b.run(
                f"cat {victim}/secret.txt; echo x > {victim}/secret.txt; touch {victim}/new; "
                f"cat {leftover}/answer.txt; ls {root}",
                5,
            )
            assert (files / "secret.txt").read_text() == "mine\n"
            assert not (files / "new").exists()
            # b sees only its own workspace in the workspaces folder.
            assert obs.output.strip().splitlines()[-1] == b.workdir.parent.name
            assert "leaked" not in obs.output and "mine" not in obs.output
            if IS_ROOT:
                assert a.isolation["uid"] != b.isolation["uid"]
    finally:
        (leftover / "answer.txt").unlink()
        leftover.rmdir()


async def test_tmp_folders_are_private_capped_and_end_with_the_episode():
    _need("private_tmp", "private tmp folders (a mount namespace)")
    tag = f"simloop-tmp-{os.getpid()}"
    cfg = LocalShellConfig(tmpfs_bytes=2**20)
    write = f"for d in /tmp /var/tmp /dev/shm; do echo kept > $d/{tag} || exit 1; done"
    read = f"cat /tmp/{tag} /var/tmp/{tag} /dev/shm/{tag}"
    async with LocalShell(cfg) as a, LocalShell(cfg) as b:
        assert (await a.run(write, 5)).exit_code == 0
        again = await a.run(read, 5)  # later commands of the episode still see them
        other = await b.run(read, 5)
        full = await a.run("head -c 2000000 /dev/zero > /dev/shm/big", 5)
    assert again.output == "kept\n" * 3
    assert other.exit_code != 0 and "kept" not in other.output
    assert full.exit_code != 0 and "No space left" in full.output
    assert not any(Path(d, tag).exists() for d in ("/tmp", "/var/tmp", "/dev/shm"))
    async with LocalShell(cfg) as later:
        assert "kept" not in (await later.run(read, 5)).output


async def test_visible_paths_stay_readable_and_read_only_under_a_private_tmp():
    _need("private_tmp", "private tmp folders (a mount namespace)")
    host = Path(f"/tmp/simloop-visible-{os.getpid()}")
    (host / "inner").mkdir(parents=True)
    (host / "inner" / "note.txt").write_text("seen\n")
    os.chmod(host, 0o755)
    os.chmod(host / "inner", 0o755)
    os.chmod(host / "inner" / "note.txt", 0o644)
    try:
        cfg = LocalShellConfig(visible_paths=[str(host / "inner"), str(host), "/no/such/dir"])
        async with LocalShell(cfg) as shown, LocalShell(LocalShellConfig()) as hidden:
            read = await shown.run(f"cat {host}/inner/note.txt", 5)
            write = await shown.run(f"echo x > {host}/inner/new.txt", 5)
            own_tmp = await shown.run("echo mine > /tmp/own && cat /tmp/own", 5)
            absent = await hidden.run(f"cat {host}/inner/note.txt", 5)
        assert read.exit_code == 0 and read.output == "seen\n"
        assert write.exit_code != 0 and not (host / "inner" / "new.txt").exists()
        assert own_tmp.output == "mine\n" and not Path("/tmp/own").exists()
        assert absent.exit_code != 0  # without it the private /tmp hides the folder
    finally:
        import shutil

        shutil.rmtree(host, ignore_errors=True)


async def test_root_is_read_only():
    _need("readonly_root", "a read-only /")
    async with LocalShell() as sh:
        obs = await sh.run("touch /simloop-probe; touch ok.txt && echo wrote", 5)
    assert "Read-only file system" in obs.output and obs.output.endswith("wrote\n")


async def test_the_root_is_minimal_no_host_home_project_or_neighbours():
    """Only system folders (read-only), the workspace and private tmp folders: the project tree
    (the grader, the tests), host homes, /sys and files beside the workspaces are not there."""
    _need("minimal_root", "a minimal root (a mount namespace)")
    beside = Path(LocalShellConfig().workspace_root or "/tmp") / f"simloop-beside-{os.getpid()}"
    beside.write_text("host file\n")
    beside.chmod(0o644)
    try:
        async with LocalShell() as sh:
            obs = await sh.run(
                f"cat {ROOT}/pyproject.toml {beside}; ls /root /home /sys /opt {ROOT.parent}; "
                "cat /etc/hostname; ls /; ls /usr/bin/bash /etc/passwd",
                5,
            )
    finally:
        beside.unlink()
    out = obs.output
    assert "[tool." not in out and "host file" not in out
    for gone in (f"{ROOT}/pyproject.toml", str(beside), "/root", "/home", "/sys", "/opt"):
        assert re.search(rf"{re.escape(gone)}'?: No such file or directory", out), (gone, out)
    listed = set(out.split("No such file or directory\n")[-1].split())
    assert {"usr", "etc", "tmp", "proc", "dev"} <= listed and not {"root", "home", "sys"} & listed
    assert "/usr/bin/bash" in out and "/etc/passwd" in out


async def test_user_namespaces_and_mounts_are_refused_inside():
    _need("userns_refused", "a seccomp filter refusing user namespaces")
    async with LocalShell() as sh:
        userns = await sh.run("unshare -Ur true; echo rc=$?", 5)
        userns_py = await sh.run(
            "python3 -c 'import os; os.unshare(os.CLONE_NEWUSER)' 2>&1 | tail -1 || true; "
            "mkdir m && mount -t tmpfs none m; echo rc=$?",
            5,
        )
        still = await sh.run("(sleep 0.01 &); wait; echo forks fine", 5)
    assert "rc=1" in userns.output and "Operation not permitted" in userns.output
    assert "rc=32" in userns_py.output or "rc=1" in userns_py.output, userns_py.output
    assert still.output == "forks fine\n"
    # Where a C compiler is, the filter's runner is the compiled one (~1 ms a command, not
    # the ~15-60 ms of a Python start).
    if any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        assert _iso()["userns_filter"] == "compiled"


async def test_the_disk_quota_ends_a_runaway_writer_with_a_clear_observation():
    _need("minimal_root", "a workspace on a sized tmpfs (a mount namespace)")
    cfg = LocalShellConfig(disk_bytes=4 * 2**20)
    async with LocalShell(cfg) as sh:
        once = await sh.run("head -c 10000000 /dev/zero > big.bin; echo rc=$?", 10)
        freed = await sh.run("rm big.bin && echo ok > small.txt && cat small.txt", 5)
        t0 = asyncio.get_running_loop().time()
        writer = "while :; do head -c 300000 /dev/zero >> log.txt 2>/dev/null; done"
        runaway = await sh.run(writer, 60)
        took = asyncio.get_running_loop().time() - t0
        left = await sh.run("rm log.txt; df -k . | tail -1", 5)
    assert "No space left on device" in once.output and once.info["disk_full"]
    assert "disk quota exceeded (4194304 bytes)" in once.output
    assert freed.output == "ok\n" and not freed.info.get("disk_full")
    assert runaway.info["killed"] == "disk_quota" and "was killed" in runaway.output
    assert took < 30 and not runaway.info.get("timeout")
    assert int(left.output.split()[1]) == 4096  # the quota's size, in KiB


def _procs_of_uid(uid: int) -> list[str]:
    """Command lines of the live processes whose real uid is `uid` (what its cap counts)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                status = Path(entry.path, "status").read_text()
                real = next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Uid:"))
                if int(real) == uid:
                    cmd = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ")
                    found.append(cmd.decode(errors="replace").strip())
            except (OSError, StopIteration):
                pass
    return found


async def test_fork_bomb_in_one_episode_does_not_disturb_another():
    if not IS_ROOT:
        pytest.skip("a uid per shell needs root (as a normal user all shells share its uid)")
    _need("distinct_uid", "a uid per shell")
    cap = 16
    cfg = LocalShellConfig(max_processes=cap)
    sleeper = ["sleep", "765.5"]
    async with LocalShell(cfg) as a, LocalShell(cfg) as b:
        uid, log = a.isolation["uid"], a.workspace / "fork.log"
        assert _procs_of_uid(uid) == []  # the cap below is the bomb's alone
        # A exhausts its uid's process cap (bash and its sleepers; bash then retries its failing
        # forks, saying so in fork.log). The bomb runs until the test cancels it, so a slow
        # machine cannot end it before it is measured; B must still fork freely meanwhile.
        bomb = "while :; do sleep 765.5 & done 2>fork.log"
        flood = asyncio.create_task(a.run(bomb, 300), name="bomb")
        try:
            full = await wait_until(lambda: len(_procs_of_uid(uid)) >= cap, 60)
            assert full, f"uid {uid} never reached its cap {cap}: {_procs_of_uid(uid)}"
            assert await wait_until(lambda: "Resource temporarily unavailable" in _read(log), 60)
            obs = await b.run("for i in $(seq 20); do /bin/true || exit 1; done; echo fine", 30)
            assert (obs.exit_code, obs.output) == (0, "fine\n")
            assert len(_procs_of_uid(uid)) == cap  # still saturated: a real test
            assert procs_running(sleeper)
        finally:
            flood.cancel()  # cancelling a command kills its whole process group
            with contextlib.suppress(asyncio.CancelledError):
                await flood
    assert await wait_until(lambda: procs_running(sleeper) == [], 10)


async def test_a_uid_is_handed_out_only_once_nothing_of_it_runs():
    """A process left running as a shell's uid (a PID namespace still being torn down after
    its shell closed) would count against the next shell's process cap: it is killed first."""
    if not IS_ROOT:
        pytest.skip("a uid per shell needs root")
    _need("distinct_uid", "a uid per shell")
    cfg = LocalShellConfig(uid_base=3_100_000 + os.getpid() % 64, uid_count=1)
    uid = cfg.uid_base
    # A root parent that reaps it, as unshare does (our own child would stay a zombie).
    reaps = f"import subprocess as s; print(s.run(['sleep', '300'], user={uid}, group={uid}))"
    stray = subprocess.Popen([sys.executable, "-c", reaps], stdout=subprocess.PIPE, text=True)
    try:
        assert await wait_until(lambda: len(_procs_of_uid(uid)) == 1, 10)
        async with LocalShell(cfg) as sh:
            assert sh.isolation["uid"] == uid
            assert f"returncode=-{int(signal.SIGKILL)}" in stray.communicate(timeout=5)[0]
            assert _procs_of_uid(uid) == []
            await sh.run("sleep 300 &", 5)  # left behind in the shell's own namespace
    finally:
        stray.kill()
        stray.wait()
    assert _procs_of_uid(uid) == []  # close waited for its processes to be gone


def _locked_elsewhere(uid: int) -> bool:
    """Whether another process finds `uid`'s lock file taken."""
    probe = (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "try: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "except BlockingIOError: sys.exit(3)"
    )
    path = os.path.join(UidSlots._folder(), f"{uid}.lock")
    code = subprocess.run([sys.executable, "-c", probe, path], timeout=30).returncode
    assert code in (0, 3)
    return code == 3


def test_a_cleanly_closed_uid_stays_held_and_is_reused_without_a_sweep(monkeypatch):
    """Each sweep reads every process's status; a uid this process held the whole time and
    found empty at close needs none, and no other process can take it meanwhile. A uid given
    back with processes left loses its lock: whoever takes it next sweeps it."""
    sweeps = []
    monkeypatch.setattr(local_uids, "pids_of_uid", lambda uid: sweeps.append(uid) or [])
    base = 3_200_000 + os.getpid() % 64
    slots = UidSlots()
    uid = slots.acquire(base, 2)
    assert (uid, sweeps) == (base, [base])
    slots.release(uid, clean=True)
    assert _locked_elsewhere(uid)
    assert slots.acquire(base, 2) == uid and sweeps == [base]  # taken back, no sweep
    other = slots.acquire(base, 2)
    assert other == base + 1 and sweeps == [base, base + 1]
    slots.release(uid)  # not clean: the lock goes
    assert not _locked_elsewhere(uid)
    assert slots.acquire(base, 2) == uid and sweeps == [base, base + 1, base]
    slots.release(uid, clean=True)
    slots.release(other, clean=True)
    assert slots.acquire(base + 1, 1) == other  # the idle pool honours the asked range


def test_the_status_scan_finds_a_process_by_its_real_uid():
    me = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert me.pid in local_uids.pids_of_uid(os.getuid())
        assert me.pid not in local_uids.pids_of_uid(os.getuid() + 12345)
    finally:
        me.kill()
        me.wait()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


async def test_each_shell_holds_its_own_uid_and_releases_it():
    if not IS_ROOT:
        pytest.skip("a uid per shell needs root")
    _need("distinct_uid", "a uid per shell")
    cfg = LocalShellConfig(uid_base=3_000_000 + os.getpid() % 64, uid_count=1)
    async with LocalShell(cfg) as a:
        with pytest.raises(ShellError, match=r"all 1 uids from LocalShellConfig.uid_base="):
            await LocalShell(cfg).start()
        assert a.isolation["uid"] == cfg.uid_base
        assert (await a.run("id -u", 5)).output == f"{cfg.uid_base}\n"
    async with LocalShell(cfg) as again:  # released at close
        assert again.isolation["uid"] == cfg.uid_base


CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from envs.local import LocalShell

    async def main():
        async with LocalShell() as sh:
            print(sh.workdir.parent, flush=True)
            await sh.run("sleep 876.25", timeout_s=600)

    asyncio.run(main())
    """
)


async def test_killed_parent_takes_its_command_along_and_its_workspace_is_swept():
    if not _iso()["parent_death"]:
        pytest.skip("setpriv --pdeathsig is not available here")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        base = Path(child.stdout.readline().strip())
        assert await wait_until(lambda: procs_running(["sleep", "876.25"]) != [], 15)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    # No finaliser ran: the command must die with its parent, the workspace waits for a sweep.
    assert await wait_until(lambda: procs_running(["sleep", "876.25"]) == [], 10)
    assert base.is_dir()
    assert sweep_stale_workspaces.__wrapped__(str(base.parent)) >= 1
    assert not base.exists()


def test_sweep_removes_only_workspaces_of_dead_owners(tmp_path):
    me = local_mod._OWNER
    init = f"1.{local_mod._start_time(1)}"
    reused = f"{os.getpid()}.1"  # our pid, another start time: a dead earlier owner
    names = [
        f"simloop-ws-{me}-a",
        f"simloop-ws-{init}-b",
        f"simloop-ws-{reused}-c",
        "simloop-ws-99999999.5-d",
        "simloop-ws-oldformat",
        "unrelated",
    ]
    for name in names:
        (tmp_path / name / "work").mkdir(parents=True)
    assert sweep_stale_workspaces.__wrapped__(str(tmp_path)) == 2
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == sorted(set(names) - {f"simloop-ws-{reused}-c", "simloop-ws-99999999.5-d"})


async def test_isolation_is_reported():
    async with LocalShell() as sh:
        report = sh.isolation
        obs = await sh.run("true", 5)
    keys = (
        "network",
        "pid_namespace",
        "mount_namespace",
        "private_proc",
        "private_tmp",
        "readonly_root",
        "distinct_uid",
        "parent_death",
        "limits",
        "uid",
    )
    assert set(keys) <= set(report)
    assert ("mntns" in obs.info["isolation"]) == report["mount_namespace"]
    assert "RLIMIT_NPROC" in report["limits"]["processes"]


def test_local_servers_get_the_admin_token_from_the_environment_not_argv(tmp_path):
    from launch.config.schema import SimloopConfig

    args = local_server_args(SimloopConfig(), "agent", tmp_path, "token-123456789")
    assert "token-123456789" not in args and "--admin-token" not in args
    assert "--checkpoint-root" in args


def _serve_args(*argv):
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(list(argv))


def test_serve_reads_the_admin_token_from_a_private_file(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SIMLOOP_ADMIN_TOKEN", raising=False)
    path = tmp_path / "token"
    path.write_text("file-token-123\n")
    path.chmod(0o600)
    overrides = serve.flag_overrides(_serve_args("--admin-token-file", str(path)))
    assert overrides[-2:] == ["--serve.server.admin_token", "file-token-123"]
    monkeypatch.setenv("SIMLOOP_ADMIN_TOKEN", "env-token-123")
    assert serve.flag_overrides(_serve_args())[-1] == "env-token-123"
    path.chmod(0o644)
    with pytest.raises(SystemExit) as exit_:
        serve.flag_overrides(_serve_args("--admin-token-file", str(path)))
    assert exit_.value.code == 2
    assert "mode 0644 lets others read it; chmod 600" in capsys.readouterr().err
