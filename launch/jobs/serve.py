"""`simloop serve`: the JAX engine behind the OpenAI/vLLM-compatible HTTP API.

    simloop serve --preset tiny --port 8000                 # random tiny weights, byte tokenizer
    simloop serve --model /models/Qwen3-0.6B --max-tokens-cap 512
    simloop serve --model /models/Qwen3-0.6B --dtype float32  # a bf16 checkpoint, fast on CPU
    SIMLOOP_ADMIN_TOKEN=$TOKEN simloop serve --config configs/demo_cpu.yaml --role simulator \\
        --checkpoint-root runs/demo/checkpoints

The model comes from `--model DIR` (an HF directory), else `--preset NAME`, else the config's
role (`agent` or `simulator`): its `weights` (what trainers export), its `hf_path`, or random
weights of its architecture.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import stat
import sys
from pathlib import Path

from launch.config.schema import SimloopConfig

# flag -> config override key
FLAG_KEYS = {
    "role": "serve.role",
    "host": "serve.server.host",
    "port": "serve.server.port",
    "checkpoint_root": "serve.server.checkpoint_root",
    "model_name": "serve.server.model_name",
    "max_tokens_cap": "serve.engine.max_tokens_cap",
    "num_slots": "serve.engine.num_slots",
    "max_seq_len": "serve.engine.max_seq_len",
    "speculate": "serve.engine.speculate",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="random weights of a preset (tiny, qwen3_0p6b, ...)")
    src.add_argument("--model", metavar="DIR", help="HF model directory to load")
    p.add_argument("--role", choices=["agent", "simulator"], help="role to serve from --config")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--admin-token",
        help="bearer token for /admin/*; prefer $SIMLOOP_ADMIN_TOKEN or --admin-token-file "
        "(any local process can read a command line)",
    )
    p.add_argument(
        "--admin-token-file", metavar="FILE", help="read the admin token from FILE (mode 0600)"
    )
    p.add_argument("--checkpoint-root", metavar="DIR", help="where /admin/load_weights may read")
    p.add_argument("--model-name", help="name served in /v1/models")
    p.add_argument("--max-tokens-cap", type=int, help="clamp every request's max_tokens")
    p.add_argument("--num-slots", type=int, help="sequences decoded together")
    p.add_argument("--max-seq-len", type=int, help="context per sequence")
    p.add_argument(
        "--speculate",
        type=int,
        metavar="K",
        help="guess up to K tokens a call by prompt lookup and verify them (the "
        "same tokens, fewer device calls where outputs copy their context; "
        "0: off)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        help="weights and compute (default: the checkpoint's or the config's; on "
        "CPU float32 decodes faster, see rl.model.with_dtype)",
    )


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """The serve flags as config overrides, so they are validated like any other key."""
    out = []
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag, None)
        if value is not None:
            out += [f"--{key}", str(value)]
    token = getattr(args, "admin_token", None) or os.environ.get("SIMLOOP_ADMIN_TOKEN")
    if getattr(args, "admin_token_file", None):
        token = _read_token_file(args.admin_token_file)
    if token:
        out += ["--serve.server.admin_token", token]
    return out


def _read_token_file(path: str) -> str:
    """The token in `path`, which only its owner may read; a bad file ends the command with
    a message (exit 2)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError("not a regular file")
            if st.st_mode & 0o077:
                raise ValueError(f"mode {st.st_mode & 0o777:04o} lets others read it; chmod 600")
            token = f.read(4096).decode("utf-8").strip()
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        sys.stderr.write(f"simloop serve: --admin-token-file {path}: {e}\n")
        raise SystemExit(2) from None
    if not token:
        sys.stderr.write(f"simloop serve: --admin-token-file {path}: the file is empty\n")
        raise SystemExit(2)
    return token


def build_model(args: argparse.Namespace, cfg: SimloopConfig):
    """-> (model, tokenizer, name) per --model / --preset / the config's role, in --dtype
    (`rl.model.loading`, the loader trainers use too)."""
    from rl.data.tokenizer import ByteTokenizer, hf_dir_tokenizer, load_tokenizer
    from rl.model.config import preset
    from rl.model.loading import ModelSource

    if args.model:
        source = ModelSource.of_dir(args.model)
        tokenizer, name = hf_dir_tokenizer(args.model), Path(args.model).name
    elif args.preset:
        source = ModelSource(architecture=preset(args.preset))
        tokenizer, name = ByteTokenizer(), args.preset
    else:
        role = getattr(cfg, cfg.serve.role)
        source = ModelSource.of_role(role)
        tokenizer, name = load_tokenizer(role.tokenizer), cfg.serve.role
    return source.build(seed=cfg.run.seed, dtype=getattr(args, "dtype", None)), tokenizer, name


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from serving.lifetime import die_with_parent

    die_with_parent()  # a server a job started ends with that job
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from serving.engine import Engine
    from serving.server import EngineDied, run_server

    model, tokenizer, name = build_model(args, cfg)
    server_cfg = cfg.serve.server
    if server_cfg.model_name == "simloop" and args.model_name is None:
        import dataclasses

        server_cfg = dataclasses.replace(server_cfg, model_name=name)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        print(
            f"simloop serve: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"{model.cfg.vocab_size} embeddings",
            file=sys.stderr,
        )
        return 2
    engine = Engine(model, tokenizer, cfg.serve.engine)

    import jax

    devices = jax.devices()

    def ready(port: int) -> None:
        print(
            f"simloop serve: listening on http://{server_cfg.host}:{port} "
            f"(model {server_cfg.model_name!r}, {model.cfg.num_params() / 1e6:.1f}M params, "
            f"{cfg.serve.engine.num_slots} slots, {len(devices)} {devices[0].platform} "
            f"device(s))",
            flush=True,
        )

    try:
        asyncio.run(run_server(engine, tokenizer, server_cfg, ready=ready))
    except EngineDied as e:  # exit non-zero: a supervisor restarts the server
        print(f"simloop serve: {e}", file=sys.stderr, flush=True)
        return 1
    st = engine.stats
    spec = ""
    if cfg.serve.engine.speculate:
        spec = (
            f"; {st['spec_steps']} verify calls kept {st['spec_kept']} of "
            f"{st['spec_guessed']} guessed tokens"
        )
    print(
        f"simloop serve: stopped ({st['requests']} requests, {st['generated_tokens']} tokens "
        f"generated in {st['steps']} device steps{spec})",
        flush=True,
    )
    return 0
