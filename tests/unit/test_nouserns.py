"""The seccomp filter refusing user namespaces (`envs/nouserns.py`), through both of its
runners: the C program compiled once per machine (what LocalShell uses where a compiler is) and
the Python file it falls back to. Both refuse `unshare -U`, run everything else, and the
compiled one is built only into a cache no one else can write."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from envs import nouserns

HAVE_CC = any(shutil.which(c) for c in ("cc", "gcc", "clang"))


def _filter_works_here() -> bool:
    try:
        nouserns.program()
    except OSError:
        return False
    done = subprocess.run([*nouserns.PYTHON_RUNNER, "true"], capture_output=True, check=False)
    return done.returncode == 0


pytestmark = pytest.mark.skipif(
    not _filter_works_here(), reason="seccomp filters cannot be installed on this machine"
)


def _runners(tmp_path) -> dict[str, tuple[str, ...]]:
    runners = {"python": nouserns.PYTHON_RUNNER}
    if HAVE_CC:
        runners["compiled"] = nouserns.runner(str(tmp_path / "cache"))
        assert runners["compiled"] != nouserns.PYTHON_RUNNER, "a compiler is here: it must build"
    return runners


@pytest.mark.parametrize("which", ["python", "compiled"])
def test_both_runners_refuse_user_namespaces_and_run_the_rest(tmp_path, which):
    runners = _runners(tmp_path)
    if which not in runners:
        pytest.skip("no C compiler on this machine: only the Python runner is used")
    run = runners[which]
    if shutil.which("unshare"):
        refused = subprocess.run(
            [*run, "unshare", "-U", "true"], capture_output=True, text=True, check=False
        )
        assert refused.returncode != 0 and "Operation not permitted" in refused.stderr
    # The raw system call (no `unshare` tool needed): -1 with EPERM (1).
    py = (
        "import ctypes; c = ctypes.CDLL(None, use_errno=True); "
        "print(c.unshare(0x10000000), ctypes.get_errno())"
    )
    refused = subprocess.run(
        [*run, sys.executable, "-c", py], capture_output=True, text=True, check=False
    )
    assert refused.stdout == "-1 1\n", refused
    forks = subprocess.run(
        [*run, "bash", "-c", "(echo child) & wait; echo $(echo sub)"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert forks.returncode == 0 and forks.stdout == "child\nsub\n"
    missing = subprocess.run(
        [*run, "no-such-program-xyz"], capture_output=True, text=True, check=False
    )
    assert missing.returncode == 127 and "no-such-program-xyz" in missing.stderr


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
def test_the_compiled_runner_is_built_once_and_only_into_a_private_cache(tmp_path):
    cache = tmp_path / "cache"
    first = nouserns.compiled(str(cache))
    assert first and os.stat(first).st_mode & 0o777 == 0o755
    mtime = os.stat(first).st_mtime_ns
    assert nouserns.compiled(str(cache)) == first and os.stat(first).st_mtime_ns == mtime
    # A cache others can write is refused: root would run what they put there.
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    assert nouserns.compiled(str(shared)) is None
    assert nouserns.runner(str(shared)) == nouserns.PYTHON_RUNNER
    # A runner binary someone else could have rewritten is not trusted: it is built again.
    os.chmod(first, 0o777)
    assert nouserns.compiled(str(cache)) == first and os.stat(first).st_mode & 0o777 == 0o755


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
def test_a_malformed_filter_is_refused_by_the_compiled_runner(tmp_path):
    path = nouserns.compiled(str(tmp_path / "cache"))
    for bad in ("", "zz" * 8, "00" * 7):
        done = subprocess.run([path, bad, "true"], capture_output=True, text=True, check=False)
        assert done.returncode == 126 and "malformed" in done.stderr, bad
