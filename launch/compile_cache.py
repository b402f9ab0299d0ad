"""JAX's persistent compilation cache for simloop's processes: a program compiled once on a
machine is loaded, not compiled, by every later process that needs it (a restarted server,
the demo's next stage, the next run). A `simloop serve` on CPU starts in ~6 s instead of ~20 s.

    enable_compile_cache(cfg.run, single_device=True)   # before the first compile

Where: `run.compile_cache_dir`, else `$SIMLOOP_COMPILE_CACHE_DIR`, else
`$XDG_CACHE_HOME/simloop/xla` (`~/.cache/simloop/xla`). Off: `--run.compile_cache false`.
JAX keys each entry on the program, the compile options, the devices and jaxlib's version, so
a stale entry is never loaded for a changed program.

One exception, measured here: on XLA:CPU, a process whose programs run collectives across
several fake devices (a trainer on a `cpu-N` plan) must compile fresh. With executables loaded
from the cache, a train-agent run on the demo's 4 fake devices died in a cross-module
all-reduce whose 4th device thread never reached the rendezvous; the same run passes compiling
fresh. So on CPU the cache serves single-device programs only: servers (the engine runs on one
device) and single-device processes. TPU and GPU processes always use it. Tried again on jaxlib
0.10.2 (2026-12-05): whole test suites passed, but a full demo aborted when its agent_real
stage, loading the agent stage's trainer programs, had two programs' collectives waiting on
each other (an all-gather on one device thread, an all-reduce on the other three; XLA's 40 s
rendezvous timeout). The exception stays.

`SIMLOOP_COMPILE_STATS=FILE` (off by default) makes a process that calls `enable_compile_cache`
write, at exit, what JAX's own instrumentation (`jax.monitoring`) summed: seconds per duration
event (backend compile, tracing, lowering; a cache hit's load counts as backend compile) and
counts per event (cache requests, hits). `bench/compile_cache.py` compares a cold and a warm
start with it.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from pathlib import Path

from serving.xla_cache import CACHE_DIR_ENV, use_compile_cache

STATS_ENV = "SIMLOOP_COMPILE_STATS"
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
"""JAX's event around each XLA compile, or its load from the persistent cache."""
COMPILE_EVENTS = ("/jax/core/compile/", "/jax/compilation_cache/")
"""The events `SIMLOOP_COMPILE_STATS` keeps (others, e.g. Orbax's, are left out)."""


def compile_cache_dir(run_cfg) -> Path:
    """The cache directory `run_cfg` (a `RunConfig`) names, or the default."""
    if run_cfg.compile_cache_dir:
        return Path(run_cfg.compile_cache_dir).expanduser()
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "simloop" / "xla"


def enable_compile_cache(run_cfg, *, single_device: bool = False) -> Path | None:
    """Point JAX at the persistent cache; the directory, or None when it stays off (turned
    off, or an XLA:CPU process with several devices whose programs are not all
    `single_device`). Call before this process compiles anything."""
    if os.environ.get(STATS_ENV):
        record_compile_stats(Path(os.environ[STATS_ENV]))
    if not run_cfg.compile_cache:
        return None
    import jax

    if not single_device and jax.default_backend() == "cpu" and jax.device_count() > 1:
        return None
    path = compile_cache_dir(run_cfg)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home: run on, compiling as before
        print(f"simloop: compilation cache off ({path} cannot be created: {e})", flush=True)
        return None
    use_compile_cache(path)
    return path


def record_compile_stats(path: Path) -> dict:
    """Sum JAX's compile and compilation-cache events in this process from now on and write
    them to `path` as JSON at exit: `{"seconds": {event: total}, "counts": {event: n}}`.
    Returns the live totals."""
    import jax.monitoring

    stats, lock = {"seconds": {}, "counts": {}}, threading.Lock()  # compiles run in threads

    def add(kind: str, event: str, value: float) -> None:
        if not event.startswith(COMPILE_EVENTS):
            return
        with lock:
            stats[kind][event] = stats[kind].get(event, 0) + value

    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: add("seconds", event, secs)
    )
    jax.monitoring.register_event_listener(lambda event, **_: add("counts", event, 1))

    def write() -> None:
        with lock:
            path.write_text(json.dumps(stats, indent=1, sort_keys=True) + "\n")

    atexit.register(write)
    return stats
