"""Decoding behind one HTTP API: the JAX engine, the aiohttp server, the async client, and the
vllm-tpu launcher (docs/architecture.md §2, §4)."""
