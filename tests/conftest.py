"""Test session set-up: 8 fake CPU devices (before anything imports JAX) and shared fixtures."""

import os
from pathlib import Path

# Must run before JAX is imported anywhere: sharding and sub-mesh code runs for real on 8 fake
# CPU devices. Set once here; never per test file.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# CPU unless the caller chose: on a TPU VM, `JAX_PLATFORMS=tpu,cpu pytest -m tpu` runs the
# hardware tests (they compare the TPU against the CPU backend).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent XLA compilation cache: with executables loaded from it, a train-agent run on
# the demo's 4 fake devices died in an XLA:CPU cross-module all-reduce whose 4th device thread
# never reached the rendezvous (40 s timeout, SIGABRT); the same run passes compiling fresh.

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def pytest_collection_modifyitems(config, items):
    import jax

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
