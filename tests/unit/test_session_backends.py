"""No silent fallback from sessions: for every backend x replica count x compaction mode x
role, a config either gets sessions from the client its job builds (one server's
`InferenceClient`, or a `ReplicaPool` of several, which places each session on one replica;
on vLLM the client keeps them, `serving.token_sessions`) or is refused when it loads, naming
the setting and what is allowed instead (vLLM cannot thin a KV cache: `turn`, `budget`)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from launch.config.loading import ConfigError, load_config
from launch.config.schema import SimloopConfig, session_settings
from launch.deploy.local import role_client_config
from serving.client import InferenceClient
from serving.pool import ReplicaPool

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"
MODES = {
    "off": None,
    "none": {},
    "markovian": {"mode": "markovian", "n_protect_turns": 1},
    "turn": {"mode": "turn", "keep_ratio": 0.5},
    "budget": {"mode": "budget", "kv_budget": 256},
}
SESSION_API = ("open_session", "session_generate", "rewind_session", "close_session")


def _overrides(role: str, backend: str, replicas: int, mode: str) -> list[str]:
    ov = ["--serve.backends", f"{{{role}: {backend}}}"]
    serve = "agent_serve" if role == "agent" else "sim_serve"
    if replicas > 1:
        ov += ["--chips.replicas", f"{{{serve}: {replicas}}}"]
    compaction = MODES[mode]
    if compaction is None:
        return ov
    section = "orchestrator" if role == "agent" else "env.shell.simulated"
    ov += [f"--{section}.sessions", "true"]
    if compaction:
        flow = ", ".join(f"{k}: {v}" for k, v in compaction.items())
        ov += [f"--{section}.session_compaction", f"{{{flow}}}"]
    return ov


@pytest.mark.parametrize(
    ("role", "backend", "replicas", "mode"),
    list(itertools.product(("agent", "simulator"), ("jax", "vllm"), (1, 2), MODES)),
)
async def test_each_roles_sessions_are_on_or_refused(role, backend, replicas, mode):
    overrides = _overrides(role, backend, replicas, mode)
    wanted = MODES[mode] is not None
    if backend == "vllm" and mode in ("turn", "budget"):
        with pytest.raises(ConfigError) as refused:
            load_config(SimloopConfig, CONFIG, overrides)
        section = "orchestrator" if role == "agent" else "env.shell.simulated"
        message = str(refused.value)
        assert f"{section}.session_compaction.mode='{mode}'" in message, message
        assert "markovian" in message and f"{{{role}: jax}}" in message, message
        return
    cfg = load_config(SimloopConfig, CONFIG, overrides)
    on = session_settings(cfg)[role]
    assert on["sessions"] is wanted
    ccfg = role_client_config(cfg, role, "http://127.0.0.1:1")
    assert ccfg.client_sessions is (backend == "vllm")
    if wanted:
        assert on["compaction"] == (MODES[mode] or {}).get("mode", "none")
        # The client the job builds for this role keeps sessions: the pool's session API is
        # its own (sessions placed on one replica), not the stateless fallback.
        client = ReplicaPool if replicas > 1 else InferenceClient
        for name in SESSION_API:
            assert callable(getattr(client, name, None)), (client, name)
        if backend == "vllm":  # kept by the client: opening one asks no server
            async with InferenceClient(ccfg) as c:
                sid = await c.open_session(compaction=MODES[mode] or None)
                assert sid is not None
                await c.close_session(sid)
