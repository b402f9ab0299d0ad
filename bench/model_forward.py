"""Model speed on this machine: training-forward and KV-cache decode tokens/s, simloop's Flax
model against HF transformers (torch, CPU) on identical weights, printed as ratios.

    .venv/bin/python bench/model_forward.py            # tiny and ~50M, both peers
    .venv/bin/python bench/model_forward.py --sizes tiny --decode-steps 32

Decode is a plain greedy loop over `jit_decode` (one jitted step per token, cache donated);
the peer is `generate(do_sample=False)` with its KV cache. The continuous-batching engine has
its own benchmark; this one measures the model.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from results import Row, add_json_flag, write_json  # bench/ is on sys.path
from rich.console import Console
from rich.table import Table

from rl.model import ModelConfig, Qwen3, jit_decode, jit_forward, save_hf, tiny

SIZES = {
    "tiny": tiny(),
    "50m": ModelConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=2048,
        num_layers=12,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    ),
}


def _alternating(fns: list, repeats: int) -> list[float]:
    """Per function, its fastest wall seconds over `repeats` rounds; each round calls every
    function in turn, so a slow spell of the machine falls on all alike (a median of one
    peer's runs, then the other's, swung 2x from run to run). In a round each function runs
    twice and the second call is timed: the first wakes its own thread pool and outlasts the
    other's, whose threads spin on both cores for milliseconds after a call (libgomp's
    default wait policy for torch; XLA's pool likewise), so neither is timed on cores the
    other still holds (our tiny forward: ~20 ms right after an HF call, ~10 ms hot)."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            fn()
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def ours(cfg, tokens, prompt_len, steps):
    """(model, forward(), generate()): our jitted forward and greedy KV-cache decode."""
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    forward = jit_forward(model)
    tokens_j = jnp.asarray(tokens)
    decode = jit_decode(model)
    prompt = tokens_j[:, :prompt_len]

    def generate():
        cache = model.init_cache(tokens.shape[0], prompt_len + steps)
        logits, cache = decode(prompt, cache)
        nxt = jnp.argmax(logits[:, -1:], axis=-1)
        for _ in range(steps - 1):
            logits, cache = decode(nxt, cache)
            nxt = jnp.argmax(logits, axis=-1)
        return nxt.block_until_ready()

    return model, lambda: forward(tokens_j).block_until_ready(), generate


def hf(cfg, model, tokens, prompt_len, steps):
    """(forward(), generate()): HF transformers on the same weights (torch CPU, no grad)."""
    import torch
    from transformers import Qwen3ForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        save_hf(cfg, model, Path(tmp))
        net = Qwen3ForCausalLM.from_pretrained(tmp).float().eval()
    tokens_t = torch.tensor(tokens)
    prompt = tokens_t[:, :prompt_len]

    @torch.no_grad()
    def forward():
        return net(tokens_t).logits

    @torch.no_grad()
    def generate():
        return net.generate(
            prompt,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones_like(prompt),
        )

    return forward, generate


def _cells(row: dict) -> list[str]:
    out = []
    for ours, peer in [("forward_tok_s", "hf_forward_tok_s"), ("decode_tok_s", "hf_decode_tok_s")]:
        out.append(f"{row[ours]:,.0f}")
        out.append(f"{row[peer]:,.0f}" if peer in row else "-")
        out.append(f"{row[ours] / row[peer]:.2f}x" if peer in row else "-")
    return out


def json_rows(results: list[dict], args) -> list[Row]:
    """The table's rows in the common shape: forward and decode per size (peer: HF)."""
    rows = []
    for r in results:
        rows += [
            Row(
                f"forward {r['size']} B={args.batch} T={args.seq}",
                r["forward_tok_s"],
                r.get("hf_forward_tok_s"),
                "tokens/s",
                ">= 1x",
            ),
            Row(
                f"decode {r['size']} B={args.batch} prompt {args.prompt} +{args.decode_steps}",
                r["decode_tok_s"],
                r.get("hf_decode_tok_s"),
                "tokens/s",
            ),
        ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256, help="training-forward sequence length")
    parser.add_argument("--prompt", type=int, default=64, help="decode prompt length")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9, help="rounds; each peer's fastest counts")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    add_json_flag(parser)
    args = parser.parse_args()

    console = Console()
    console.print(f"devices: {jax.devices()}  batch={args.batch}")
    table = Table(title="simloop model vs HF transformers (tokens/s, higher is better)")
    for col in [
        "size",
        "params",
        "forward (ours)",
        "forward (HF)",
        "ratio",
        "decode (ours)",
        "decode (HF)",
        "ratio",
    ]:
        table.add_column(col, justify="right")
    results = []
    for name in args.sizes:
        cfg = SIZES[name]
        rng = np.random.RandomState(0)
        tokens = rng.randint(0, cfg.vocab_size, (args.batch, args.seq))
        with console.status(f"{name}: simloop and transformers, in turn"):
            model, fwd, gen = ours(cfg, tokens, args.prompt, args.decode_steps)
            peers = (
                [] if args.no_hf else list(hf(cfg, model, tokens, args.prompt, args.decode_steps))
            )
            fwd_s, *hf_fwd = _alternating([fwd, *peers[:1]], args.repeats)
            gen_s, *hf_gen = _alternating([gen, *peers[1:]], max(1, args.repeats // 2))
        row = {
            "size": name,
            "params": cfg.num_params(),
            "forward_tok_s": args.batch * args.seq / fwd_s,
            "decode_tok_s": args.batch * args.decode_steps / gen_s,
        }
        if peers:
            row["hf_forward_tok_s"] = args.batch * args.seq / hf_fwd[0]
            row["hf_decode_tok_s"] = args.batch * args.decode_steps / hf_gen[0]
        results.append(row)

        table.add_row(name, f"{row['params'] / 1e6:.1f}M", *_cells(row))
    console.print(table)
    console.print(
        f"forward: batch {args.batch} x {args.seq} tokens; decode: batch {args.batch}, prompt "
        f"{args.prompt}, {args.decode_steps} greedy steps (prefill included in decode time)."
    )
    if args.json:
        write_json(args.json, "model_forward", json_rows(results, args), results)


if __name__ == "__main__":
    main()
