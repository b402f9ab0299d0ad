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
        vocab_size=8192, hidden_size=512, intermediate_size=2048, num_layers=12, num_heads=8,
        num_kv_heads=4, head_dim=64, rope_theta=1_000_000.0, tie_word_embeddings=True,
    ),
}  # fmt: skip


def _time(fn, repeats: int) -> float:
    """Median wall seconds of `fn()` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def bench_ours(cfg, tokens, prompt_len, steps, repeats):
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    forward = jit_forward(model)
    tokens_j = jnp.asarray(tokens)
    fwd_s = _time(lambda: forward(tokens_j).block_until_ready(), repeats)

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

    gen_s = _time(generate, max(1, repeats // 2))
    return model, fwd_s, gen_s


def bench_hf(cfg, model, tokens, prompt_len, steps, repeats):
    import torch
    from transformers import Qwen3ForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        save_hf(cfg, model, Path(tmp))
        hf = Qwen3ForCausalLM.from_pretrained(tmp).float().eval()
    tokens_t = torch.tensor(tokens)
    with torch.no_grad():
        fwd_s = _time(lambda: hf(tokens_t).logits, repeats)
        prompt = tokens_t[:, :prompt_len]
        gen_s = _time(
            lambda: hf.generate(
                prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                pad_token_id=0, attention_mask=torch.ones_like(prompt),
            ),
            max(1, repeats // 2),
        )  # fmt: skip
    return fwd_s, gen_s


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
            Row(f"forward {r['size']} B={args.batch} T={args.seq}", r["forward_tok_s"],
                r.get("hf_forward_tok_s"), "tokens/s", ">= 1x"),
            Row(f"decode {r['size']} B={args.batch} prompt {args.prompt} +{args.decode_steps}",
                r["decode_tok_s"], r.get("hf_decode_tok_s"), "tokens/s"),
        ]  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256, help="training-forward sequence length")
    parser.add_argument("--prompt", type=int, default=64, help="decode prompt length")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    add_json_flag(parser)
    args = parser.parse_args()

    console = Console()
    console.print(f"devices: {jax.devices()}  batch={args.batch}")
    table = Table(title="simloop model vs HF transformers (tokens/s, higher is better)")
    for col in ["size", "params", "forward (ours)", "forward (HF)", "ratio",
                "decode (ours)", "decode (HF)", "ratio"]:  # fmt: skip
        table.add_column(col, justify="right")
    results = []
    for name in args.sizes:
        cfg = SIZES[name]
        rng = np.random.RandomState(0)
        tokens = rng.randint(0, cfg.vocab_size, (args.batch, args.seq))
        with console.status(f"{name}: simloop"):
            model, fwd_s, gen_s = bench_ours(
                cfg, tokens, args.prompt, args.decode_steps, args.repeats
            )
        row = {
            "size": name,
            "params": cfg.num_params(),
            "forward_tok_s": args.batch * args.seq / fwd_s,
            "decode_tok_s": args.batch * args.decode_steps / gen_s,
        }
        if not args.no_hf:
            with console.status(f"{name}: transformers"):
                hf_fwd_s, hf_gen_s = bench_hf(
                    cfg, model, tokens, args.prompt, args.decode_steps, args.repeats
                )
            row["hf_forward_tok_s"] = args.batch * args.seq / hf_fwd_s
            row["hf_decode_tok_s"] = args.batch * args.decode_steps / hf_gen_s
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
