"""simloop's JAX inference engine: continuous batching over a slot pool with a KV cache."""

from serving.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from serving.engine.errors import EngineBusy, EngineError, SessionError
from serving.engine.state import SequenceOutput, Session, TokenEvent

__all__ = [
    "Engine",
    "EngineBusy",
    "EngineConfig",
    "EngineError",
    "SamplingParams",
    "SequenceOutput",
    "Session",
    "SessionError",
    "TokenEvent",
]
