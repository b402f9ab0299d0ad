"""A local server's environment (`launch.deploy.local.server_env`): ours without the admin
token, the chip plan's laid over it, and glibc's huge-page tunable unless someone set theirs."""

import os

from launch.deploy.local import ADMIN_TOKEN_ENV, MALLOC_TUNABLES, server_env


def test_servers_get_the_huge_page_tunable_and_not_our_admin_token(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "secret")
    monkeypatch.setenv("SIMLOOP_TEST_MARK", "inherited")
    env = server_env(None)
    assert env["GLIBC_TUNABLES"] == MALLOC_TUNABLES == "glibc.malloc.hugetlb=1"
    assert ADMIN_TOKEN_ENV not in env and env["SIMLOOP_TEST_MARK"] == "inherited"
    planned = server_env({"TPU_VISIBLE_CHIPS": "3", ADMIN_TOKEN_ENV: "theirs"})
    assert planned["TPU_VISIBLE_CHIPS"] == "3" and planned[ADMIN_TOKEN_ENV] == "theirs"
    assert planned["GLIBC_TUNABLES"] == MALLOC_TUNABLES


def test_a_tunable_already_set_is_kept(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert server_env(None)["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
    monkeypatch.delenv("GLIBC_TUNABLES")
    planned = server_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert planned["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"


def test_server_xla_flags_replace_the_jobs_own_but_keep_the_planned_device_count(monkeypatch):
    from serving.lifetime import PARENT_PID_ENV, SERVER_XLA_FLAGS_ENV, child_env

    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    monkeypatch.delenv(SERVER_XLA_FLAGS_ENV, raising=False)
    planned = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    # Unset: the job's flags, then the plan's device count.
    job = "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=1"
    assert child_env(server_env(planned))["XLA_FLAGS"] == job
    assert child_env(server_env(planned))[PARENT_PID_ENV] == str(os.getpid())
    # Set: the servers' own flags in place of the job's; the device count stays.
    monkeypatch.setenv(SERVER_XLA_FLAGS_ENV, "--xla_dump_to=/tmp/x")
    assert child_env(server_env(planned))["XLA_FLAGS"] == (
        "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=1"
    )
    # Set empty: XLA's defaults (full optimisation), the count kept where there is one.
    monkeypatch.setenv(SERVER_XLA_FLAGS_ENV, "")
    assert child_env(server_env(planned))["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"
    assert "XLA_FLAGS" not in child_env(server_env(None))
