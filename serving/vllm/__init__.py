"""vllm-tpu as simloop's inference server (docs/architecture.md §5): start it, and publish
weights to it.

    launcher          `vllm serve` per serving process of the chip plan, health-checked
    worker_extension  `OrbaxWeightLoader`, loaded into vLLM's workers (`--worker-extension-cls`)
    publisher         `VllmPublisher`, the trainer's `WeightPublisher` over `/collective_rpc`

The trainer calls the publisher; the publisher calls the servers the launcher started; the
worker extension runs inside those servers and is never imported by simloop's own processes.
Names are resolved lazily, so importing the package (as vLLM does to reach the extension)
pulls in nothing else.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ServedModel": "serving.vllm.launcher",
    "VllmLaunchError": "serving.vllm.launcher",
    "VllmServer": "serving.vllm.launcher",
    "build_vllm_command": "serving.vllm.launcher",
    "build_vllm_env": "serving.vllm.launcher",
    "launch_servers": "serving.vllm.launcher",
    "stop_servers": "serving.vllm.launcher",
    "VllmPublishError": "serving.vllm.publisher",
    "VllmPublisher": "serving.vllm.publisher",
    "OrbaxWeightLoader": "serving.vllm.worker_extension",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'serving.vllm' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
