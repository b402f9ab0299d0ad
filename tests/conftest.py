"""Test session set-up: 8 fake CPU devices (before anything imports JAX) and shared fixtures."""

import os
from pathlib import Path

# XLA:CPU flags for the test processes: the tests' programs are tiny, so compiling them costs
# more than running them. The backend's cheapest optimisation level cut the compile-bound unit
# tests' time by ~30% (test_train_core + test_model: 141 s -> 101 s); at that level most of
# what is left is XLA's MLIR fusion emitters, and the older emitters compile the same fusions
# in about half the CPU (test_model + test_train_core + test_engine: 188 -> 101 CPU seconds,
# 2026-12-05). They change no semantics (float results may differ in the last bits, as on any
# other machine). For a job of hundreds of steps the full level runs faster than it compiles
# slower: see tests.fakes.user_env.
FAST_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
    "--xla_cpu_use_fusion_emitters=false"
)
# Must run before JAX is imported anywhere: sharding and sub-mesh code runs for real on 8 fake
# CPU devices. Set once here; never per test file.
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS} "
    "--xla_force_host_platform_device_count=8"
).strip()
# CPU unless the caller chose: on a TPU VM, `JAX_PLATFORMS=tpu,cpu pytest -m tpu` runs the
# hardware tests (they compare the TPU against the CPU backend).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The simloop processes the tests start share one persistent compilation cache for this test
# run (launch/compile_cache.py: on CPU only single-device programs, i.e. the servers' engines;
# in-process tests compile as before), so the many `simloop serve` starts of the suite compile
# their engine once. A fresh directory per run (the controller makes it, xdist workers and
# every subprocess inherit it): nothing leaks between runs or into ~/.cache.
if "SIMLOOP_COMPILE_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["SIMLOOP_COMPILE_CACHE_DIR"] = tempfile.mkdtemp(prefix="simloop-test-xla-")
    atexit.register(shutil.rmtree, os.environ["SIMLOOP_COMPILE_CACHE_DIR"], True)
# The same for train-sim's and eval-sim's cache of replayed workspaces (envs/workspace.py).
if "SIMLOOP_REPLAY_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _replays = tempfile.mkdtemp(prefix="simloop-test-replays-")
    os.environ["SIMLOOP_REPLAY_CACHE"] = os.path.join(_replays, "workspace-replays.sqlite")
    atexit.register(shutil.rmtree, _replays, True)

import pytest  # noqa: E402

from tests.cpu_report import CPU_REPORT_ENV, cpu_seconds  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


# The files whose module fixtures run whole jobs (minutes each) go first: under `make test`'s
# two workers (one file per worker at a time) a long file started last would leave the other
# worker idle at the end.
LONG_FILES = (  # longest first (wall seconds in a fresh-clone `make test`, 2026-12-05)
    "test_demo.py",  # ~290 (demo --quick, the gating experiment, a rerun)
    "test_multihost.py",  # ~215 (SFT as one and as two processes, a killed process; RL)
    "test_train_agent.py",  # ~210 (the learning criterion)
    "test_entry_points.py",  # ~195 (the bench smoke runs)
    "test_npm_harnesses.py",  # ~160 (npm installs when not cached; 14-18k-token prompts)
    "test_harness.py",  # ~155 (mini-swe-agent, and train-agent through it)
    "test_replica_restart.py",  # ~130
    "test_train_cli.py",  # ~105
    "test_rehearse.py",  # ~90 (gke-v6e-32's eight pods on CPU)
    "test_rollout_e2e.py",  # ~65
    "test_pretrain_sim.py",  # ~55
    "test_simulated_shell_live.py",  # ~35
    "test_compaction_parity.py",  # ~35
    "test_chip_plan_cpu.py",  # ~30
    "test_bench_sessions.py",  # ~20
    "test_pool_sessions.py",  # ~15
)


def pytest_collection_modifyitems(config, items):
    import jax

    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable

    on_tpu = any(d.platform == "tpu" for d in jax.devices())
    skip_tpu = pytest.mark.skip(reason="needs TPU hardware (jax.devices() has no TPU)")
    for item in items:
        if "tpu" in item.keywords and not on_tpu:
            item.add_marker(skip_tpu)


@pytest.fixture(scope="session")
def swe_agent_trajectories() -> Path:
    """The real SWE-agent trajectories in ../shared/data (skips in a clone without them)."""
    path = SHARED_DATA / "swe-agent-trajectories"
    if not path.is_dir():
        pytest.skip(f"{path} is absent: real-data tests need ../shared beside the checkout")
    return path


if os.environ.get(CPU_REPORT_ENV):
    # `SIMLOOP_TEST_CPU=FILE make test`: each test's CPU seconds, this process's and those of
    # the processes it started and reaped (servers, jobs), its wall seconds, its worker and
    # when it ended, one line per test appended to FILE;
    # `python -m tests.cpu_report FILE` sums them by file. On 2 cores the suite's wall time is
    # its CPU time over 2, so this says where the minutes go.
    import time

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        own0, children0, wall0 = *cpu_seconds(), time.monotonic()
        yield
        own1, children1 = cpu_seconds()
        with open(os.environ[CPU_REPORT_ENV], "a") as f:
            f.write(
                f"{item.nodeid}\t{own1 - own0:.2f}\t{children1 - children0:.2f}\t"
                f"{time.monotonic() - wall0:.2f}\t"
                f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\t{time.time():.2f}\n"
            )
