"""bench/compile_cache.py's reading of a process's compile stats and its rows (a full run
starts `simloop serve` and `pretrain-sim` twice each: about a minute, run by hand)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from launch.compile_cache import BACKEND_COMPILE

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the bench imports its neighbour `results` by name
_spec = importlib.util.spec_from_file_location("bench_compile_cache", BENCH / "compile_cache.py")
bench = sys.modules["bench_compile_cache"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _stats(xla: float, trace: float, hits: int, misses: int) -> dict:
    """A `SIMLOOP_COMPILE_STATS` document as `launch.compile_cache` writes it."""
    cache = "/jax/compilation_cache/"
    counts = {cache + "compile_requests_use_cache": hits + misses}
    counts.update({cache + k: n for k, n in (("cache_hits", hits), ("cache_misses", misses)) if n})
    return {
        "counts": counts,
        "seconds": {
            BACKEND_COMPILE: xla,
            "/jax/core/compile/jaxpr_trace_duration": trace,
            "/jax/core/compile/jaxpr_to_mlir_module_duration": 0.5,
            "/jax/compilation_cache/cache_retrieval_time_sec": 0.25,  # inside the XLA phase
        },
    }


def test_compile_seconds_separates_xla_from_all_phases_and_counts_the_cache():
    got = bench.compile_seconds(_stats(16.0, 1.5, hits=0, misses=39))
    assert got == {"xla_s": 16.0, "all_s": 18.0, "hits": 0, "misses": 39}
    assert bench.compile_seconds({}) == {"xla_s": 0.0, "all_s": 0, "hits": 0, "misses": 0}


def test_rows_compare_warm_with_cold_as_a_speedup_against_the_target():
    cold = {"health_s": 20.0, **bench.compile_seconds(_stats(16.0, 1.5, hits=0, misses=39))}
    warm = {"health_s": 4.0, **bench.compile_seconds(_stats(0.4, 1.6, hits=39, misses=0))}
    run_cold = {"wall_s": 30.0, "xla_s": 20.0, "all_s": 24.0, "hits": 0, "misses": 12}
    run_warm = {"wall_s": 10.0, "xla_s": 0.5, "all_s": 4.0, "hits": 12, "misses": 0}
    rows = bench.rows(
        {
            "serve": {"cold": cold, "warm": warm},
            "pretrain-sim": {"cold": run_cold, "warm": run_warm},
        }
    )
    got = [(r.ours, r.peer, r.ratio, r.target, r.unit) for r in rows]
    assert got == [
        (4.0, 20.0, 5.0, None, "s"),
        (0.4, 16.0, pytest.approx(40.0), ">= 5x", "s"),
        (2.5, 18.0, pytest.approx(7.2), None, "s"),
        (10.0, 30.0, 3.0, None, "s"),
        (0.5, 20.0, 40.0, ">= 5x", "s"),
        (4.0, 24.0, 6.0, None, "s"),
    ]
    assert "serve" in rows[0].measure and "pretrain-sim" in rows[3].measure


def test_a_process_that_wrote_no_stats_is_named(tmp_path):
    with pytest.raises(RuntimeError, match=f"no compile stats to {tmp_path / 'x.json'}"):
        bench._stats(tmp_path / "x.json")
