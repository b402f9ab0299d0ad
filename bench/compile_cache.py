"""Compiled once per machine: the same command started twice on one fresh compilation cache
(`launch/compile_cache.py`), cold (empty) then warm, for

- `simloop serve`, the demo config's agent role (`launch.deploy.local.LocalServer`, as jobs
  start it): wall seconds from process start to a healthy `/health` and to a first completion;
- `simloop pretrain-sim` at a tiny size on one CPU device (the cache serves only single-device
  programs on CPU): wall seconds of the whole run (real-bash transcripts, 2 steps, an eval).

Compile seconds come from JAX's own instrumentation inside each process
(`SIMLOOP_COMPILE_STATS`): `backend_compile_duration` is XLA's compile, or its load from the
cache; tracing and lowering run in every process, cache or not, and are shown beside it.

    .venv/bin/python bench/compile_cache.py                      # ~1-2 minutes on 2 cores
    .venv/bin/python bench/compile_cache.py --skip-trainer       # serve only
    .venv/bin/python bench/compile_cache.py --json compile_cache.json

Target (issue 23): the warm run spends >= 5x less time compiling.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from results import Row, add_json_flag, table, write_json  # bench/ is on sys.path
from rich.console import Console

from launch.compile_cache import BACKEND_COMPILE, CACHE_DIR_ENV, STATS_ENV
from launch.deploy.local import LocalServer
from rl.data.rundir import CONFIG

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo_cpu.yaml"
PRETRAIN = [
    "--chips.accelerator", "cpu-1", "--chips.roles", "{sim_train: 1}",
    "--simulator.mesh.fsdp", "1", "--pretrain_sim.cases", "8", "--pretrain_sim.eval_cases", "2",
    "--pretrain_sim.steps", "2", "--pretrain_sim.short_steps", "1",
    "--pretrain_sim.short_data.batch_size", "2", "--pretrain_sim.data.batch_size", "2",
    "--pretrain_sim.eval_every", "2", "--pretrain_sim.log_every", "1",
]  # fmt: skip
"""A tiny pretrain-sim whose trainer runs on one device (a 1-device plan and mesh)."""
ONE_DEVICE = "--xla_force_host_platform_device_count=1"


def compile_seconds(stats: dict) -> dict:
    """A process's `SIMLOOP_COMPILE_STATS` document -> seconds in XLA's compile (or cache load),
    in all of JAX's compile phases (tracing, lowering, XLA), and the cache's hits and misses."""
    seconds, counts = stats.get("seconds", {}), stats.get("counts", {})
    return {
        "xla_s": seconds.get(BACKEND_COMPILE, 0.0),
        "all_s": sum(v for k, v in seconds.items() if k.startswith("/jax/core/compile/")),
        "hits": counts.get("/jax/compilation_cache/cache_hits", 0),
        "misses": counts.get("/jax/compilation_cache/cache_misses", 0),
    }


def _stats(path: Path) -> dict:
    if not path.exists():
        raise RuntimeError(f"the process wrote no compile stats to {path} (did it exit cleanly?)")
    return compile_seconds(json.loads(path.read_text()))


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def serve_once(run_dir: Path, cache: Path, name: str) -> dict:
    """Start `simloop serve --role agent` on the run directory's config with `cache`, time it
    to `/health` and to a first completion, stop it; the seconds and its compile stats."""
    stats = run_dir / f"{name}-stats.json"
    env = {CACHE_DIR_ENV: str(cache), STATS_ENV: str(stats)}
    began = time.perf_counter()
    with LocalServer.start("agent", run_dir, env=env, name=name) as server:
        with urllib.request.urlopen(f"{server.url}/health", timeout=60):  # raises unless 2xx
            pass
        health_s = time.perf_counter() - began
        _post(
            f"{server.url}/v1/completions",
            {"prompt": "echo hi", "max_tokens": 8, "temperature": 0.0},
        )
        first_s = time.perf_counter() - began
    if server.proc.returncode != 0:
        tail = server.log_path.read_text()[-2000:]
        raise RuntimeError(f"the server exited {server.proc.returncode}; its log ends:\n{tail}")
    return {"health_s": health_s, "first_completion_s": first_s, **_stats(stats)}


def pretrain_once(out: Path, cache: Path, name: str) -> dict:
    """One tiny `simloop pretrain-sim` run in its own process with `cache`: wall seconds and
    its compile stats."""
    stats = out.parent / f"{name}-stats.json"
    env = {**os.environ, CACHE_DIR_ENV: str(cache), STATS_ENV: str(stats), "XLA_FLAGS": ONE_DEVICE}
    cmd = [sys.executable, "-m", "launch", "pretrain-sim", "--config", str(DEMO), "--out",
           str(out), *PRETRAIN]  # fmt: skip
    began = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    wall_s = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"pretrain-sim failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return {"wall_s": wall_s, **_stats(stats)}


def rows(results: dict) -> list[Row]:
    """The table: per command, its start (or run) and its compile seconds, warm (ours) vs
    cold (peer), as cold/warm ratios."""
    out = []
    labels = {
        "serve": ("simloop serve (demo agent) start to /health", "health_s"),
        "pretrain-sim": ("simloop pretrain-sim (tiny, 1 device) run", "wall_s"),
    }
    for command, runs in results.items():
        what, key = labels[command]
        cold, warm = runs["cold"], runs["warm"]
        out += [
            Row(f"{what}, warm vs cold cache", warm[key], cold[key], "s", ratio_of="peer/ours"),
            Row(
                f"{command}: XLA compile seconds, warm vs cold",
                warm["xla_s"],
                cold["xla_s"],
                "s",
                target=">= 5x",
                ratio_of="peer/ours",
            ),
            Row(
                f"{command}: all JAX compile seconds (+ tracing, lowering), warm vs cold",
                warm["all_s"],
                cold["all_s"],
                "s",
                ratio_of="peer/ours",
            ),
        ]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-trainer", action="store_true", help="measure simloop serve only")
    add_json_flag(parser)
    args = parser.parse_args()
    console = Console()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="simloop-compile-cache-") as tmp:
        tmp = Path(tmp)
        shutil.copy(DEMO, tmp / CONFIG)
        try:  # each command its own fresh, empty cache: its first run is cold
            results["serve"] = {
                temp: serve_once(tmp, tmp / "xla-serve", f"serve-{temp}")
                for temp in ("cold", "warm")
            }
            if not args.skip_trainer:
                results["pretrain-sim"] = {
                    temp: pretrain_once(
                        tmp / f"pretrain-{temp}", tmp / "xla-pretrain", f"pretrain-{temp}"
                    )
                    for temp in ("cold", "warm")
                }
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
            print(f"bench/compile_cache.py: {e}", file=sys.stderr)
            return 1
    for command, runs in results.items():
        for temp, r in runs.items():
            cells = (f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items())
            console.print(f"{command} {temp}: {', '.join(cells)}")
    table_rows = rows(results)
    console.print(
        table(f"compilation cache: cold vs warm start ({os.cpu_count()} cores)", table_rows)
    )
    if args.json:
        write_json(args.json, "compile_cache", table_rows, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
