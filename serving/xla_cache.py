"""JAX's persistent compilation cache pointed at a directory: the one switch behind
`launch.compile_cache` (simloop's own processes) and the fake `vllm serve`
(`serving/vllm/fake_server.py`), which keeps its compiled programs where vLLM-TPU keeps its
own, in `VLLM_XLA_CACHE_PATH`."""

from __future__ import annotations

from pathlib import Path

CACHE_DIR_ENV = "SIMLOOP_COMPILE_CACHE_DIR"
"""The cache directory simloop's processes (and the fake `vllm serve`) use when it is set."""
MAX_SIZE_BYTES = 4 << 30
"""Least recently used entries go beyond this."""


def use_compile_cache(path: str | Path) -> None:
    """Compile into, and load from, `path` from now on (it must exist). Call before the
    process compiles anything it should find there."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(path))
    # A size cap turns on JAX's LRU eviction, and with it a file lock around every read and
    # write: without it, a server reading an entry another process is still writing could
    # load half an executable (JAX's plain writes are not atomic).
    jax.config.update("jax_compilation_cache_max_size", MAX_SIZE_BYTES)
    # Tiny CPU programs compile in well under JAX's default 1 s threshold, and together they
    # are most of a server's start-up: cache every program.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
