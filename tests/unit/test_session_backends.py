"""No silent fallback from KV sessions: for every backend x replica count x compaction mode x
role, a config either gets sessions from the client its job builds (one server's
`InferenceClient`, or a `ReplicaPool` of several, which places each session on one replica)
or is refused when it loads, naming the setting and what is allowed instead (vLLM keeps no
sessions)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from launch.config.loading import ConfigError, load_config
from launch.config.schema import SimloopConfig, session_settings
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
def test_each_roles_sessions_are_on_or_refused(role, backend, replicas, mode):
    overrides = _overrides(role, backend, replicas, mode)
    wanted = MODES[mode] is not None
    if wanted and backend == "vllm":
        with pytest.raises(ConfigError) as refused:
            load_config(SimloopConfig, CONFIG, overrides)
        setting = "orchestrator.sessions" if role == "agent" else "env.shell.simulated.sessions"
        message = str(refused.value)
        assert setting in message and "vllm" in message and f"{{{role}: jax}}" in message
        return
    cfg = load_config(SimloopConfig, CONFIG, overrides)
    on = session_settings(cfg)[role]
    assert on["sessions"] is wanted
    if wanted:
        assert on["compaction"] == (MODES[mode] or {}).get("mode", "none")
        # The client the job builds for this role keeps sessions: the pool's session API is
        # its own (sessions placed on one replica), not the stateless fallback.
        client = ReplicaPool if replicas > 1 else InferenceClient
        for name in SESSION_API:
            assert callable(getattr(client, name, None)), (client, name)
