"""A tiny random agent that real harnesses' prompts fit: a 4,096-id byte-level BPE trained on
this repository's docs and serving code (`rl/data/bpe.py`), and a `tiny` Qwen3 of that
vocabulary saved as an HF checkpoint in the same directory. Claude Code's ~49,000-character
first request is ~18,000 of its tokens (Codex's ~15,000), so with a 32,768-token context both
clients run end to end on a CPU (the model is random: it never solves anything).

    .venv/bin/python dev/bpe_agent.py runs/bpe-agent
    .venv/bin/simloop harness --config configs/demo_cpu.yaml --out runs/claude-code \\
        --agent.hf_path runs/bpe-agent \\
        --agent.tokenizer '{"kind": "hf", "path": "runs/bpe-agent"}' \\
        --harness.kind claude-code ...        (README: "Real harnesses")

tests/integration/test_npm_harnesses.py and bench/harness_clients.py build the same agent."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bpe_agent(out: Path, *, vocab_size: int = 4096, seed: int = 0) -> Path:
    """Write the tokenizer and the random tiny model into `out`; returns `out`."""
    from flax import nnx

    from rl.data.bpe import train_bpe
    from rl.data.tokenizer import HFTokenizer
    from rl.model import Qwen3, save_hf, tiny

    texts = [p.read_text() for p in sorted(REPO.glob("docs/*.md")) + [REPO / "README.md"]]
    texts += [p.read_text() for p in sorted((REPO / "serving").rglob("*.py"))]
    train_bpe(texts, out, vocab_size=vocab_size)
    cfg = tiny(vocab_size=HFTokenizer(out).vocab_size, initializer_range=0.3)
    save_hf(cfg, Qwen3(cfg, rngs=nnx.Rngs(seed)), out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the directory to write (created)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = bpe_agent(args.out, vocab_size=args.vocab_size, seed=args.seed)
    print(f"wrote a {args.vocab_size}-id BPE and a random tiny Qwen3 to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
