"""simloop's JAX inference engine: continuous batching over a slot pool with a KV cache."""

from serving.config import EngineConfig, SamplingParams
from serving.engine.engine import (
    Engine,
    EngineBusy,
    EngineError,
    SequenceOutput,
    TokenEvent,
)
from serving.engine.sessions import Session, SessionError

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
