"""Live vllm-tpu: `launch_servers` starts a real server on one chip, `VllmPublisher` swaps its
weights through the worker extension, and greedy generations show which weights it serves.

Needs a TPU VM with vllm-tpu installed. pytest itself must hold only part of the host (its JAX
backend is initialised by conftest), so that the server can have a chip of its own:

    TPU_VISIBLE_CHIPS=0 TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1 TPU_PROCESS_BOUNDS=1,1,1 \
    TPU_PROCESS_PORT=8476 TPU_PROCESS_ADDRESSES=localhost:8476 CLOUD_TPU_TASK_ID=0 \
    JAX_PLATFORMS=tpu,cpu pytest -m tpu tests/integration/test_vllm_tpu_live.py

The check does not depend on matching numerics between simloop and tpu-inference: the server
starts from HF weights A (loaded by vLLM itself), is published B, then A again through
`load_orbax_weights`; the last generation must equal the first token for token, which holds
only if every tensor went to the right place in the right layout.
"""

import asyncio
import glob
import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "needs a TPU VM with vllm-tpu installed (vllm is not importable here)",
        allow_module_level=True,
    )

from flax import nnx  # noqa: E402

from rl.model import Qwen3, save_hf, tiny  # noqa: E402
from rl.model.params_io import save_params  # noqa: E402
from serving.client import ClientConfig, InferenceClient  # noqa: E402
from serving.vllm.config import VllmConfig  # noqa: E402
from serving.vllm.launcher import ServedModel, launch_servers, stop_servers  # noqa: E402
from serving.vllm.publisher import VllmPublisher  # noqa: E402
from tests.fakes import PlannedProcess as Proc  # noqa: E402
from tests.fakes import build_hf_tokenizer, free_port  # noqa: E402

pytestmark = [pytest.mark.tpu, pytest.mark.slow]

PROMPT = list(range(1, 13))
GEN = 8


def _server_chip() -> int:
    ours = os.environ.get("TPU_VISIBLE_CHIPS")
    if not ours or not os.environ.get("TPU_CHIPS_PER_PROCESS_BOUNDS"):
        pytest.skip("pytest holds the whole TPU host; run it on a chip subset (module docstring)")
    chips = sorted(glob.glob("/dev/accel*")) or sorted(glob.glob("/dev/vfio/[0-9]*"))
    free = [c for c in range(len(chips)) if str(c) not in ours.split(",")]
    if not free:
        pytest.skip(f"no TPU chip outside pytest's TPU_VISIBLE_CHIPS={ours}")
    return free[0]


async def _greedy(url: str) -> list[int]:
    async with InferenceClient(ClientConfig(url, model="tiny", timeout_s=300.0)) as client:
        out = await client.complete(PROMPT, max_tokens=GEN, temperature=0.0)
    assert len(out.token_ids) == GEN
    return out.token_ids


def test_published_weights_are_the_weights_served(tmp_path):
    chip = _server_chip()
    cfg = tiny(initializer_range=0.3)
    weights_a, weights_b = Qwen3(cfg, rngs=nnx.Rngs(0)), Qwen3(cfg, rngs=nnx.Rngs(1))
    hf_dir = save_hf(cfg, weights_a, tmp_path / "hf", dtype="bfloat16")
    build_hf_tokenizer(hf_dir)
    ckpt_a = save_params(weights_a, tmp_path / "weights" / "v000003", dtype="bfloat16")
    ckpt_b = save_params(weights_b, tmp_path / "weights" / "v000002", dtype="bfloat16")

    tpu_port = int(os.environ.get("TPU_PROCESS_PORT", "8476")) + 1
    proc = Proc(
        "agent_serve",
        (chip,),
        free_port(),
        {
            "TPU_VISIBLE_CHIPS": str(chip),
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_PORT": str(tpu_port),
            "TPU_PROCESS_ADDRESSES": f"localhost:{tpu_port}",
            "CLOUD_TPU_TASK_ID": "0",
            "VLLM_XLA_CACHE_PATH": str(tmp_path / "xla_cache"),
        },
    )
    # The server gets its own chip environment, not pytest's (nor conftest's fake CPU devices).
    base_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TPU_", "CLOUD_TPU_")) and k != "XLA_FLAGS"
    }
    vllm_cfg = VllmConfig(
        max_model_len=256,
        gpu_memory_utilization=0.3,
        health_timeout_s=1500.0,
        extra_args=["--max-num-seqs", "8"],
    )
    servers = launch_servers(
        [proc],
        vllm_cfg,
        {"agent_serve": ServedModel(str(hf_dir), "tiny")},
        log_dir=tmp_path / "logs",
        base_env=base_env,
        poll_s=5.0,
    )
    try:
        url = servers[0].url

        async def scenario():
            before = await _greedy(url)
            async with VllmPublisher([url], model_name="tiny", timeout_s=600.0) as publisher:
                report_b = await publisher.publish(str(ckpt_b), 2)
                with_b = await _greedy(url)
                report_a = await publisher.publish(str(ckpt_a), 3)
                with_a = await _greedy(url)
                served, _ = await publisher.clients[0].request(
                    "POST", "/collective_rpc", json_body={"method": "simloop_weight_version"}
                )
            return before, with_b, with_a, report_b, report_a, served

        before, with_b, with_a, report_b, report_a, served = asyncio.run(scenario())
        assert with_b != before, "publishing other weights did not change the generation"
        assert with_a == before, "weights A reloaded through the extension generate differently"
        assert report_b.first_token_s is not None and report_a.version == 3
        assert served["results"] == [{"version": 3, "path": str(ckpt_a)}]
    finally:
        stop_servers(servers)
