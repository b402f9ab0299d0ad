"""The persistent compilation cache (launch/compile_cache.py): where it lives, when it stays
off, and that a process using it writes entries a later process loads. Each case runs in a
fresh interpreter: JAX's cache settings are process-wide, and the test process itself (8 fake
CPU devices) must never use it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.compile_cache import BACKEND_COMPILE, CACHE_DIR_ENV, STATS_ENV, compile_cache_dir
from launch.config.schema import RunConfig

PROBE = """
import sys, time
from launch.compile_cache import enable_compile_cache
from launch.config.schema import RunConfig
import jax, jax.numpy as jnp
cfg = RunConfig(compile_cache={on}, compile_cache_dir={where!r})
print("dir", enable_compile_cache(cfg, single_device={single}))
print("sum", float(jax.jit(lambda x: jnp.tanh(x) @ x.T)(jnp.ones((64, 64))).sum()))
jax.monitoring.record_event_duration_secs("/jax/orbax/read/total_duration_secs", 1.0)
"""


def _probe(tmp_path: Path, *, on: bool = True, single: bool = False, devices: int = 1,
           stats: Path | None = None) -> str:  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", CACHE_DIR_ENV, STATS_ENV)}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    if stats is not None:
        env[STATS_ENV] = str(stats)
    code = PROBE.format(on=on, where=str(tmp_path / "xla"), single=single)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _entries(tmp_path: Path) -> list[str]:
    folder = tmp_path / "xla"
    return sorted(p.name for p in folder.glob("*-cache")) if folder.is_dir() else []


def test_a_single_device_process_writes_entries_the_next_one_loads(tmp_path):
    first = _probe(tmp_path)
    assert f"dir {tmp_path / 'xla'}" in first
    written = _entries(tmp_path)
    assert written, "the first process cached nothing"
    second = _probe(tmp_path)
    assert second.splitlines()[-1] == first.splitlines()[-1]  # the same program, same result
    assert _entries(tmp_path) == written  # loaded, not compiled and written again


def test_compile_stats_show_the_warm_process_loading_what_the_cold_one_compiled(tmp_path):
    """SIMLOOP_COMPILE_STATS: JAX's own compile events, summed by the process and written at
    exit (what bench/compile_cache.py compares)."""
    _probe(tmp_path, stats=tmp_path / "cold.json")
    _probe(tmp_path, stats=tmp_path / "warm.json")
    cold, warm = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("cold", "warm"))
    misses = cold["counts"]["/jax/compilation_cache/cache_misses"]
    assert misses >= 1 and "/jax/compilation_cache/cache_hits" not in cold["counts"]
    assert warm["counts"]["/jax/compilation_cache/cache_hits"] == misses
    assert "/jax/compilation_cache/cache_misses" not in warm["counts"]
    assert cold["seconds"][BACKEND_COMPILE] > 0 and warm["seconds"][BACKEND_COMPILE] > 0
    # Only compile events: the probe's Orbax-like event is left out.
    assert all(k.startswith(("/jax/core/compile/", "/jax/compilation_cache/"))
               for doc in (cold, warm) for kind in doc.values() for k in kind)  # fmt: skip


@pytest.mark.parametrize("case", ["turned_off", "cpu_with_several_devices"])
def test_the_cache_stays_off(tmp_path, case):
    out = _probe(tmp_path, on=case != "turned_off", devices=4 if case != "turned_off" else 1)
    assert "dir None" in out and _entries(tmp_path) == []


def test_servers_use_it_on_a_several_device_cpu_process(tmp_path):
    """A server's engine runs on one device however many the process has."""
    assert "dir None" not in _probe(tmp_path, single=True, devices=4)
    assert _entries(tmp_path)


def test_where_it_lives(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache_dir(RunConfig()) == tmp_path / "xdg" / "simloop" / "xla"
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "env"))
    assert compile_cache_dir(RunConfig()) == tmp_path / "env"
    assert compile_cache_dir(RunConfig(compile_cache_dir="~/c")) == Path.home() / "c"


@pytest.mark.parametrize("field,value", [("compile_cache", "yes"), ("compile_cache_dir", "")])
def test_bad_settings_are_named(field, value):
    with pytest.raises(ValueError, match=f"RunConfig.{field}="):
        RunConfig(**{field: value})
