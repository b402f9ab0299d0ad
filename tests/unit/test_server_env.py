"""A local server's environment (`launch.deploy.local.server_env`): ours without the admin
token, the chip plan's laid over it, and glibc's huge-page tunable unless someone set theirs."""

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
