"""`simloop lookup-drill`: teach trained serving weights to find a line by its content.

    simloop lookup-drill configs/pretrained/sim-fileops --out runs/lookup --steps 600

A simulator that keeps files in its prompt must copy from them: `tail -n 1 log.txt` prints
`pearl-15`, and the `15` is in the file alone. The shipped lineage never formed the
attention that finds a line by what it starts with (its pretraining's induction probe is 0.0
in every run), and fine-tuning on whole observations does not form it either: the number is
2 tokens of a ~100-token target. This drill trains on nothing but that step. Each row is a
listing of 2-6 numbered lines (`word-NN`, distinct words: half the rows from the fileops
words, half fresh 3-7-letter strings), then `$ lookup word` and `word-`; the loss is on the
number and its newline only. Rows are fresh every step (never repeated), so the model cannot
memorise them. A held-out set of rows is scored every `--eval-every` steps (exact: both
digits right) and the curve goes to `lookup_drill.json` beside the weights.

`--task count` drills the other read a simulator gets wrong with its files right, `wc -l <
file`: a listing of one to three files (`== name ==`, then 1..N lines of words or numbered
lines), then `$ count name`; the loss is on the named file's line count and its newline. Of
stage 7's 19 `wc -l` misses on seed 11, 16 miscount a file it holds right (dev/LOG.md,
2026-12-07 fifth). `--task both` draws each row from either drill, and the held-out curve is
scored per drill. Measured there: the count drill's rows are learned (0.414 in 400 steps,
mixed with lookups) but fine-tuning after it does not carry the count into `wc -l <`.

It is a warm-up, not a simulator: the rows are not in the simulator's prompt format, so
fine-tune after it (`simloop train-sim --simulator.weights OUT/weights/final ...`).
Measured on sim-fileops' stage 7 with the defaults (dev/LOG.md, 2026-12-07 fourth): held-out exact
0.000 -> 0.836 in 600 steps, 206 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from launch.config.schema import SimloopConfig
from launch.errors import UsageError

RESULT = "lookup_drill.json"
TASKS = ("lookup", "count", "both")
COUNT_FILES = 3  # the most files a count row lists
EVAL_ROWS = 128
WARMUP = 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The lookup-drill flags; `--config` comes from the CLI itself (it is not read)."""
    p.add_argument("weights", metavar="WEIGHTS", help="a serving-weights directory")
    p.add_argument("--out", metavar="DIR", required=True, help="run directory to write into")
    p.add_argument("--steps", type=int, default=600, help="training steps (default 600)")
    p.add_argument("--batch", type=int, default=32, help="rows per step (default 32)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--min-lines", type=int, default=2, help="fewest listed lines (default 2)")
    p.add_argument("--max-lines", type=int, default=6, help="most listed lines (default 6)")
    p.add_argument("--eval-every", type=int, default=100, help="steps between held-out scores")
    p.add_argument("--seed", type=int, default=1, help="the rows' random seed (default 1)")
    p.add_argument(
        "--task",
        choices=TASKS,
        default="lookup",
        help="lookup (a line's number by its word), count (a file's lines) or both "
        "(default lookup)",
    )


def lookup_row(rng: random.Random, min_lines: int, max_lines: int) -> tuple[str, str]:
    """(context, target): a listing of numbered lines and a query whose answer is the number
    of one line, found by the word it starts with."""
    from envs.fileops import DRILL_FILES

    n = rng.randint(min_lines, max_lines)
    lines = [f"{w}-{rng.randint(0, 99):02d}" for w in _distinct_words(rng, n)]
    word, number = rng.choice(lines).split("-")
    name = rng.choice(DRILL_FILES)
    context = f"== {name} ==\n" + "\n".join(lines) + f"\n$ lookup {word}\n{word}-"
    return context, f"{number}\n"


def _distinct_words(rng: random.Random, n: int) -> list[str]:
    """`n` distinct words: half the time the fileops words, else fresh 3-7-letter strings."""
    from envs.fileops import WORDS, fresh_words

    return rng.sample(WORDS, n) if rng.random() < 0.5 else fresh_words(rng, n, shortest=3)


def count_row(rng: random.Random, min_lines: int, max_lines: int) -> tuple[str, str]:
    """(context, target): a listing of one to three files and a query whose answer is the
    number of lines of one of them, named by its file."""
    from envs.fileops import DRILL_FILES

    names = rng.sample(DRILL_FILES, rng.randint(1, min(COUNT_FILES, len(DRILL_FILES))))
    blocks, counts = [], {}
    for name in names:
        n = rng.randint(min_lines, max_lines)
        words = _distinct_words(rng, n)
        if rng.random() < 0.5:
            words = [f"{w}-{rng.randint(0, 99):02d}" for w in words]
        blocks.append(f"== {name} ==\n" + "".join(f"{w}\n" for w in words))
        counts[name] = n
    name = rng.choice(names)
    return "".join(blocks) + f"$ count {name}\n", f"{counts[name]}\n"


def lookup_batch(
    rng: random.Random,
    rows: int,
    length: int,
    min_lines: int,
    max_lines: int,
    task: str = "lookup",
):
    """(tokens [rows, length], loss mask [rows, length]) of `task`'s rows (`both`: each row
    from either drill): the mask marks the positions that predict the target's bytes."""
    import numpy as np

    from rl.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    tokens = np.zeros((rows, length), np.int32)
    mask = np.zeros((rows, length), np.float32)
    for i in range(rows):
        kind = task if task != "both" else rng.choice(("lookup", "count"))
        row = lookup_row if kind == "lookup" else count_row
        context, target = row(rng, min_lines, max_lines)
        ctx, ids = tok.encode(context), tok.encode(context + target)
        if len(ids) > length:
            raise ValueError(f"a row of {len(ids)} tokens does not fit {length}")
        tokens[i, : len(ids)] = ids
        mask[i, len(ctx) - 1 : len(ids) - 1] = 1
    return tokens, mask


def _row_length(max_lines: int, task: str = "lookup") -> int:
    # the longest lookup row: "== notes.txt ==\n" (16 bytes), lines of a 7-letter word, "-NN"
    # and a newline (11 each, the last newline starting the query), "$ lookup " + word +
    # "\n" + word + "-" (25), the target "NN\n" (3)
    lookup = 16 + 11 * max_lines + 28
    # the longest count row: three such files, "$ count notes.txt\n" (18), the target "NN\n"
    count = COUNT_FILES * (16 + 11 * max_lines) + 18 + 3
    return {"lookup": lookup, "count": count, "both": max(lookup, count)}[task]


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    for flag, value, least in (
        ("--steps", args.steps, 1),
        ("--batch", args.batch, 1),
        ("--min-lines", args.min_lines, 1),
        ("--eval-every", args.eval_every, 1),
    ):
        if value < least:
            raise UsageError(f"{flag} must be at least {least}; got {value}")
    from envs.fileops import WORDS

    if not args.min_lines <= args.max_lines <= len(WORDS):
        raise UsageError(
            f"--max-lines must be between --min-lines ({args.min_lines}) and {len(WORDS)} (the "
            f"fileops words); got {args.max_lines}"
        )
    if not 0 < args.lr < 1:
        raise UsageError(f"--lr must be in (0, 1); got {args.lr}")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out} is not empty: choose a new directory")

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from rl.model.loading import ModelSource
    from rl.model.params_io import read_model_config, save_params
    from rl.train.config import OptimConfig
    from rl.train.losses import token_logprobs
    from rl.train.optim import make_optimizer

    read_model_config(Path(args.weights))  # FileNotFoundError (exit 2) when it is not weights
    model = ModelSource(weights=str(args.weights)).build(seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    length = _row_length(args.max_lines, args.task)

    def loss_fn(params, tokens, mask):
        logits = nnx.merge(graphdef, params)(tokens)[:, :-1]
        targets = tokens[:, 1:]
        nll = -token_logprobs(logits, targets)[0]
        m = mask[:, :-1]
        right = (jnp.argmax(logits, -1) == targets) | (m == 0)
        return (nll * m).sum() / m.sum(), right.all(-1).mean()

    # The trainers' optimizer (warmup, cosine to 0.1 of the peak, clipping), with Adam's
    # usual b2: the rows are fresh every step and the gradients noisy.
    opt = make_optimizer(
        OptimConfig(lr=args.lr, warmup_steps=WARMUP, b2=0.999, weight_decay=0.0, clip_norm=1.0),
        args.steps,
    )
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, tokens, mask):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, mask)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    score = jax.jit(loss_fn)
    drills = ("lookup", "count") if args.task == "both" else (args.task,)
    held = {
        d: lookup_batch(
            # the lookup rows as they were before `--task` (the measured curves)
            random.Random(f"{args.seed}:held-out" + ("" if d == "lookup" else f":{d}")),
            EVAL_ROWS,
            length,
            args.min_lines,
            args.max_lines,
            d,
        )
        for d in drills
    }
    curve: list[dict] = []

    def evaluate(at: int) -> None:
        point: dict = {"step": at}
        for d, (tokens, mask) in held.items():
            loss, exact = score(params, jnp.asarray(tokens), jnp.asarray(mask))
            point[f"loss_{d}"], point[f"exact_{d}"] = round(float(loss), 4), float(exact)
        point["loss"] = round(sum(point[f"loss_{d}"] for d in drills) / len(drills), 4)
        point["exact"] = sum(point[f"exact_{d}"] for d in drills) / len(drills)
        curve.append(point)
        each = ", ".join(f"{d} {point[f'exact_{d}']:.3f}" for d in drills)
        print(
            f"simloop lookup-drill: step {at}: held-out loss {point['loss']:.3f}, "
            f"exact {point['exact']:.3f}" + (f" ({each})" if len(drills) > 1 else ""),
            flush=True,
        )

    rng = random.Random(args.seed)
    start = time.time()
    evaluate(0)
    for i in range(1, args.steps + 1):
        tokens, mask = lookup_batch(
            rng, args.batch, length, args.min_lines, args.max_lines, args.task
        )
        params, opt_state, _ = step(params, opt_state, jnp.asarray(tokens), jnp.asarray(mask))
        if i % args.eval_every == 0 or i == args.steps:
            evaluate(i)
    nnx.update(model, params)
    weights = save_params(model, out / "weights" / "final")
    record = {
        "weights": str(args.weights),
        "command": " ".join(["simloop", *sys.argv[1:]]),
        "steps": args.steps,
        "batch": args.batch,
        "lr": args.lr,
        "task": args.task,
        "lines": [args.min_lines, args.max_lines],
        "seed": args.seed,
        "wall_s": round(time.time() - start, 1),
        "curve": curve,
        "exact": curve[-1]["exact"],
    }
    (out / RESULT).write_text(json.dumps(record, indent=1) + "\n")
    first, last = curve[0], curve[-1]
    print(
        f"simloop lookup-drill: held-out exact {first['exact']:.3f} -> {last['exact']:.3f} "
        f"in {args.steps} steps ({record['wall_s']:.0f} s) -> {weights}"
    )
    return 0
