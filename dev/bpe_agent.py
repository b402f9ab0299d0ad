"""Tiny agents that real harnesses' prompts fit: a 4,096-id byte-level BPE trained on this
repository's docs and serving code (`rl/data/bpe.py`), and a `tiny` Qwen3 of that vocabulary
saved as an HF checkpoint in the same directory: random weights (`bpe_agent`), or weights set
by hand to call a client's shell tool once and then answer "Done." (`tool_calling_agent`,
`--tool-calls claude-code|codex`), so that a real client makes a tool round. Claude Code's
~49,000-character first request is ~18,000 of its tokens (Codex's ~15,000), so with a
32,768-token context both clients run end to end on a CPU (neither model solves anything).

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


def with_added_tokens(src, out, tokens: list[str]):
    """A copy of the HF tokenizer directory `src` in `out` with `tokens` added to its
    vocabulary (as an HF tokenizer's added tokens: matched whole in any text it encodes)."""
    import shutil
    from pathlib import Path

    from tokenizers import Tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(src) / "tokenizer_config.json", out / "tokenizer_config.json")
    tok = Tokenizer.from_file(str(Path(src) / "tokenizer.json"))
    tok.add_tokens(tokens)
    tok.save(str(out / "tokenizer.json"))
    return out


def tool_calling_model(tok, *, prompt_end: int, calls: list[str], answer: str):
    """A Qwen3 whose weights are set by hand so that, at temperature 1, it writes one of
    `calls` (each as likely; e.g. tool calls) after a prompt ending in token `prompt_end`,
    and `answer` once the context holds one of the calls' tokens (spliced back verbatim after
    the call was made): the model a real harness needs to make a tool round on a CPU. Each
    reply must split into tokens used once across all of them (`_distinct_tokens`;
    `with_added_tokens` makes a long piece one token). -> (config, model).

    One layer, untied LM head, hidden 256. Each token of a reply has its own residual
    dimension (its embedding's "code"); the LM head maps a code to the next token's logit
    (the replies are chains of distinct ids, so a token's successor is unique), the last one
    to `<|im_end|>`. The switch: every query attends uniformly (q = 0) and the value reads only
    a marker dimension, which the calls' tokens carry, so the attention output is (markers
    so far) / (position + 1), > 0 exactly once a call was made; the MLP turns any such value
    (down to 1/20,000 of a 32,768-token context) into 1 on a switch dimension
    (silu(z) - silu(z - 20) saturates), which moves the first token from the calls' to the
    answer's. Margins are >= 40 logits, so the sampler's other choices have probability
    < 1e-13. RL keeps it working only at small learning rates: the switch's MLP activations
    are in the hundreds, so an Adam step of 1e-3 on its output weights (every one moves by
    about the learning rate) adds ~1 to every residual dimension; tests train it at 1e-5."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from rl.model import Qwen3, tiny

    *call_ids, answer_ids = _distinct_tokens(tok, [*calls, answer], avoid={prompt_end})
    chain = [prompt_end, *(t for c in call_ids for t in c), *answer_ids]
    H, B, M, V, S = 256, 250, 251, 252, 253
    assert len(chain) < B, "replies too long for the codes"
    code = {t: i for i, t in enumerate(chain)}
    end = tok.encode("<|im_end|>")[0]
    cfg = tiny(
        vocab_size=tok.vocab_size, hidden_size=H, intermediate_size=64, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=16, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    c2 = 1 / np.sqrt(2 / H)  # a normalised unit where two dimensions are 1 (a code, B)
    embed = np.zeros((tok.vocab_size, H), np.float32)
    embed[:, B] = 1.0
    for t, i in code.items():
        embed[t, i] = 1.0
    for t in (t for c in call_ids for t in c):
        embed[t, M] = 1.0
    zeros = lambda a: np.zeros(a.shape, np.float32)  # noqa: E731
    p = model.layers
    q, k, v, o = (zeros(x.get_value()) for x in (p.attn.q, p.attn.k, p.attn.v, p.attn.o))
    # q = 0 and a zero QK-norm scale: the scores stay ~0 (uniform attention) even after RL
    # steps move q off zero, which the norm alone would scale up to unit size.
    p.attn.q_norm.weight.set_value(jnp.zeros(p.attn.q_norm.weight.get_value().shape))
    v[0, M, 0, 0] = 1 / c2  # a marker's value: ~1
    o[0, 0, 0, V] = 1.0  # head 0 (kv head 0): markers / (position + 1) onto V
    gate, up, down = (zeros(x.get_value()) for x in (p.mlp.gate, p.mlp.up, p.mlp.down))
    G, T = 62_000.0, 20.0
    gate[0, V, 0] = gate[0, V, 1] = G
    gate[0, B, 1] = -T / c2
    up[0, B, 0], up[0, B, 1] = 1 / c2, -1 / c2
    down[0, 0, S] = down[0, 1, S] = 1 / T
    L = 10.0
    head = np.zeros((H, tok.vocab_size), np.float32)
    for reply in (*call_ids, answer_ids):
        for x, y in zip(reply, [*reply[1:], end], strict=True):
            head[code[x], y] = L
    for c in call_ids:  # every call as likely before a call was made, none after
        head[code[prompt_end], c[0]] = L
        head[S, c[0]] = -L
    head[code[prompt_end], answer_ids[0]] = 0.5 * L
    head[S, answer_ids[0]] = 0.5 * L
    for param, value in ((model.embed, embed), (p.attn.q, q), (p.attn.k, k), (p.attn.v, v),
                         (p.attn.o, o), (p.mlp.gate, gate), (p.mlp.up, up),
                         (p.mlp.down, down), (model.lm_head, head)):  # fmt: skip
        param.set_value(jnp.asarray(value))
    return cfg, model


def _distinct_tokens(tok, texts: list[str], avoid: set[int]) -> list[list[int]]:
    """Each text as vocabulary tokens that decode to it, no id used twice across all of them
    (nor any of `avoid`): a depth-first search over the vocabulary, longest tokens first."""
    by_text: dict[str, list[int]] = {}
    for i in range(tok.vocab_size):
        s = tok.decode([i])
        if s and "\ufffd" not in s:
            by_text.setdefault(s, []).append(i)
    longest = max(len(s) for s in by_text)
    used = set(avoid)

    def split(text: str, at: int) -> list[int] | None:
        if at == len(text):
            return []
        for n in range(min(longest, len(text) - at), 0, -1):
            for i in by_text.get(text[at : at + n], []):
                if i in used:
                    continue
                used.add(i)
                rest = split(text, at + n)
                if rest is not None:
                    return [i, *rest]
                used.discard(i)
        return None

    out = []
    for text in texts:
        ids = split(text, 0)
        assert ids is not None, f"no split of {text!r} into distinct tokens"
        assert tok.decode(ids) == text
        out.append(ids)
    return out


SHELL_TOOLS = {
    "claude-code": ("Bash", "command"),
    "codex": ("exec_command", "cmd"),
    "mini-swe-agent": ("bash", "command"),
}
"""Each client's shell tool and its command argument, as their requests declare them."""
TOOL_COMMAND = "touch simloop-was-here"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""What mini-swe-agent reads as the end of the task (its output's first line)."""


def tool_calling_agent(
    src: Path,
    out: Path,
    kind: str,
    *,
    commands: tuple[str, ...] = (TOOL_COMMAND,),
    enable_thinking: bool = False,
) -> tuple[Path, list[str]]:
    """The agent of `src` (`bpe_agent`) made to call `kind`'s shell tool once with one of
    `commands` (each as likely), then to answer: "Done." (Claude Code, Codex), or a call of
    `SUBMIT` (mini-swe-agent, which needs a command to end). Written to `out`: `src`'s
    tokenizer with each whole call as one added token, and `tool_calling_model`'s weights,
    for prompts rendered as the middleware renders them (`enable_thinking`:
    `middleware.enable_thinking`). -> (out, the first turn's calls as text)."""
    import json

    from rl.data import ChatRenderer
    from rl.data.tokenizer import HFTokenizer
    from rl.model import save_hf

    tool, arg = SHELL_TOOLS[kind]

    def call(command: str) -> str:
        return f"<tool_call>{json.dumps({'name': tool, 'arguments': {arg: command}})}</tool_call>"

    calls = [call(c) for c in commands]
    answer = call(SUBMIT) if kind == "mini-swe-agent" else "Done."
    added = [*calls, *([answer] if kind == "mini-swe-agent" else [])]
    tok = HFTokenizer(with_added_tokens(src, out, added))
    end = ChatRenderer(tok).render(
        [{"role": "user", "content": "x"}],
        add_generation_prompt=True,
        enable_thinking=enable_thinking,
    )
    cfg, model = tool_calling_model(tok, prompt_end=end[-1], calls=calls, answer=answer)
    save_hf(cfg, model, out)
    return out, calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the directory to write (created)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tool-calls",
        choices=sorted(SHELL_TOOLS),
        help="instead of random weights, ones that call this client's shell tool once "
        f"({TOOL_COMMAND!r}) and then answer",
    )
    p.add_argument(
        "--command",
        action="append",
        dest="commands",
        metavar="CMD",
        help=f"with --tool-calls: a command its first call may run (repeat: each as likely; "
        f"default {TOOL_COMMAND!r})",
    )
    args = p.parse_args(argv)
    if args.commands and not args.tool_calls:
        p.error("--command goes with --tool-calls")
    if args.tool_calls:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            src = bpe_agent(Path(tmp) / "bpe", vocab_size=args.vocab_size, seed=args.seed)
            commands = tuple(args.commands or (TOOL_COMMAND,))
            out, calls = tool_calling_agent(src, args.out, args.tool_calls, commands=commands)
        print(f"wrote a tool-calling tiny Qwen3 ({calls[0]}, then an answer) and its BPE to {out}")
        return 0
    out = bpe_agent(args.out, vocab_size=args.vocab_size, seed=args.seed)
    print(f"wrote a {args.vocab_size}-id BPE and a random tiny Qwen3 to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
