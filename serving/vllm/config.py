"""`VllmConfig`: how `vllm serve` is started for a serving role on TPU (no JAX, no vLLM
import), read by `serving/vllm/launcher.py` and the `vllm` section of the root config."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl import validate


@dataclass(frozen=True)
class VllmConfig:
    """`vllm serve` for a serving role on TPU (vllm-tpu).

    Real vLLM needs an HF model directory with the tokenizer files of an HF tokenizer
    (`tokenizer.json`, `tokenizer_config.json`): the byte tokenizer of the tiny CPU models has
    none, so a byte-tokenized role runs only against the fake server
    (`serving.vllm.fake_server`, through `command`)."""

    command: list[str] = field(default_factory=lambda: ["vllm", "serve"])
    """The argv prefix that starts a server (the model directory and flags follow), e.g.
    `[python, -m, serving.vllm.fake_server, serve]` to run the tests' fake vLLM."""

    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    """HBM share for weights + KV cache (vLLM keeps the GPU name on TPU)."""
    start_stagger_s: float = 20.0
    """Pause between starting two servers on one host (libtpu and the compile caches)."""
    health_timeout_s: float = 1800.0
    """How long to wait for `/health` (the first XLA compile is slow)."""
    speculate: int = 0
    """Speculative decoding by n-gram lookup, that many tokens a step: `--speculative-config`
    with vLLM's `ngram` method (what `serve.engine.speculate` does in simloop's engine); 0: off."""
    speculate_ngram: int = 3
    """Longest n-gram looked up (vLLM's `prompt_lookup_max`; `prompt_lookup_min` is 1)."""
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        validate.require(
            isinstance(self.command, list)
            and self.command
            and all(isinstance(a, str) and a for a in self.command),
            self,
            "command",
            "a non-empty list of non-empty strings",
        )
        validate.integer(self, "max_model_len", allowed="a positive integer")
        validate.integer(self, "max_model_len", low=16, allowed="a positive integer >= 16")
        validate.number(
            self, "gpu_memory_utilization", low=0, high=1, low_open=True, allowed="in (0, 1]"
        )
        validate.integer(self, "speculate", low=0, high=32)
        validate.integer(self, "speculate_ngram", low=1, high=8)
        validate.require(
            validate.is_number(self.start_stagger_s)
            and validate.is_number(self.health_timeout_s)
            and self.start_stagger_s >= 0
            and self.health_timeout_s > 0,
            self,
            "health_timeout_s",
            "stagger >= 0, timeout > 0",
        )
