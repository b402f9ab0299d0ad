"""A server a job started ends when the job is killed outright (`serving.lifetime`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from serving.lifetime import PARENT_PID_ENV, die_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux prctl")

# The "job": starts a "server" that arms die_with_parent and waits for SIGTERM, prints its pid,
# then sleeps until it is killed.
JOB = r"""
import os, subprocess, sys, time
from serving.lifetime import child_env
server = subprocess.Popen([sys.executable, "-c", SERVER], env=child_env(os.environ),
                          start_new_session=True)
print(server.pid, flush=True)
time.sleep(600)
"""
SERVER = r"""
import signal, sys, time
from serving.lifetime import die_with_parent
signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
assert die_with_parent()
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (not yet reaped by init) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_server_ends_when_the_job_that_started_it_is_killed():
    job = subprocess.Popen(
        [sys.executable, "-c", f"SERVER = {SERVER!r}\n{JOB}"], stdout=subprocess.PIPE, text=True
    )
    server = int(job.stdout.readline())
    time.sleep(1.0)  # the server armed itself
    assert _alive(server)
    job.send_signal(signal.SIGKILL)
    job.wait()
    deadline = time.monotonic() + 10
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(server), "the server outlived the job that started it"


def test_an_orphan_exits_at_once_and_no_parent_named_is_a_no_op():
    # Its named parent is not its parent (the job died before the server armed itself). In a
    # process of its own: arming it here would tie this test process to its parent.
    code = "from serving.lifetime import die_with_parent; die_with_parent(); print('ran on')"
    env = {**os.environ, PARENT_PID_ENV: str(os.getpid() + 10_000_000)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "is gone; exiting" in done.stderr and not done.stdout
    assert die_with_parent({}) is False
    assert die_with_parent({PARENT_PID_ENV: "not-a-pid"}) is False
