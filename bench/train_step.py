"""Trainer speed and async RL on this machine, each number against a peer from the same run:

1. trainer throughput and MFU: tokens/s of `Trainer.step` (SFT loss, steady state after the
   compile step) for the tiny and ~51M models; MFU = achieved model FLOP/s over the float32
   matmul peak measured at the start of the run;
2. async vs sync RL: wall-clock of the same RL steps through the real orchestrator
   (`RolloutRunner` + `RolloutBuffer` + `rl_loop` + a tiny policy-loss `Trainer` +
   `InMemoryPublisher`) with staleness S=2 against S=0. Fake agent servers take a per-episode
   latency drawn from a straggler-heavy lognormal (CV ~0.8); an in-memory shell keeps bash
   processes out of the measurement.

    .venv/bin/python bench/train_step.py
    .venv/bin/python bench/train_step.py --quick      # smaller, for a smoke test

Targets (docs/architecture.md §7): a compiled step with MFU reported against a measured peak; async
(S=2) wall-clock <= 0.7x sync (S=0) under straggler-heavy episode lengths.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import tempfile
import time
from pathlib import Path
from statistics import NormalDist
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from model_forward import SIZES  # bench/ is on sys.path: the same models as that bench
from results import Row, add_json_flag, table, write_json  # bench/ is on sys.path
from rich.console import Console

from envs.config import TerminalConfig, TextopsConfig
from envs.textops import TextopsAnswerShell, generate_textops
from rl.data import ByteTokenizer, ChatRenderer
from rl.data.tokenizer import IM_START
from rl.model.config import ModelConfig, tiny
from rl.model.publish import InMemoryPublisher
from rl.orchestrator.buffer import RolloutBuffer
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.runner import Backends, RolloutRunner
from rl.train.config import OptimConfig, PolicyLossConfig
from rl.train.loop import rl_loop
from rl.train.rollouts import build_rl_batch
from rl.train.trainer import Trainer

FLOPS_FORMULA = "6·P + 12·L·T·N·H per token (P params incl. tied embedding; causal not halved)"
TURNS = 3  # agent replies per episode: two commands, then `submit`
SHORT_PROMPT = (
    "{instruction}\nReply with one ```bash block per turn; finish with `submit <answer>`."
)
TERMINAL = TerminalConfig(max_turns=TURNS + 1, prompt_template=SHORT_PROMPT)
_OUTPUT = re.compile(r"<output>\n(.*?)\n</output>", re.S)


# ----- 1. trainer throughput and MFU ---------------------------------------------------------


def matmul_peak(n: int, repeats: int) -> float:
    """FLOP/s of a jitted float32 [n, n] @ [n, n], best of `repeats` (after a warm-up)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    mm = jax.jit(jnp.matmul)
    mm(a, b).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        mm(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """Training (forward + backward) FLOPs per token: see FLOPS_FORMULA."""
    attn = 12 * cfg.num_layers * seq * cfg.num_heads * cfg.head_dim
    return 6 * cfg.num_params() + attn


def sft_batch(cfg: ModelConfig, rows: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    tokens = np.random.RandomState(seed).randint(0, cfg.vocab_size, (rows, seq + 1))
    ones = np.ones((rows, seq), np.int32)
    return {
        "tokens": tokens[:, :-1].astype(np.int32),
        "targets": tokens[:, 1:].astype(np.int32),
        "loss_mask": ones,
        "segment_ids": ones,
        "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)).copy(),
    }


def bench_trainer(name: str, rows: int, seq: int, steps: int, peak: float) -> dict:
    """Steady-state SFT steps: one compile step, then `steps` steps with a single sync at the
    end (the step itself never syncs)."""
    cfg = SIZES[name]
    trainer = Trainer(
        cfg, OptimConfig(), total_steps=steps + 1, loss="sft", valid_vocab=cfg.vocab_size
    )
    batch = sft_batch(cfg, rows, seq)
    start = time.perf_counter()
    jax.block_until_ready(trainer.step(batch))
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        metrics = trainer.step(batch)
    jax.block_until_ready(metrics)
    step_s = (time.perf_counter() - start) / steps
    tok_s = rows * seq / step_s
    achieved = tok_s * flops_per_token(cfg, seq)
    return dict(
        size=name,
        params=cfg.num_params(),
        rows=rows,
        seq=seq,
        steps=steps,
        compile_s=compile_s,
        step_s=step_s,
        tokens_per_s=tok_s,
        flops_per_s=achieved,
        mfu=achieved / peak,
        loss=float(metrics["loss"]),
    )


# ----- 2. async vs sync RL through the orchestrator ------------------------------------------


class StragglerAgent:
    """A fake agent server. The i-th episode to start takes `latencies[i]` seconds, spread over
    its TURNS replies (an episode is recognised across turns by its sampling seed, which the
    orchestrator sets to `episode_seed * 1000 + turn`); `wrong[i]` makes it submit a wrong
    answer, so groups have reward variance. Replies are valid bash in ByteTokenizer ids with
    logprob -0.5, tagged with the version the publisher last made it serve."""

    def __init__(self, latencies: np.ndarray, wrong: np.ndarray):
        self.tok = ByteTokenizer()
        self.latencies, self.wrong = latencies, wrong
        self.version = 0
        self.started = 0
        self._episodes: dict[int, tuple[float, bool]] = {}

    async def complete(self, prompt, *, max_tokens, seed=None, **_):
        text = self.tok.decode(prompt)
        turn = text.count(f"{IM_START}assistant") - 1
        key = (seed - turn) % 2**31
        if turn == 0:
            i = self.started % len(self.latencies)
            self._episodes[key] = (float(self.latencies[i]), bool(self.wrong[i]))
            self.started += 1
        latency, wrong = self._episodes[key]
        await asyncio.sleep(latency / TURNS)
        if turn < TURNS - 1:
            reply = "Look.\n```bash\ncat input.txt\n```"
        else:
            del self._episodes[key]
            m = _OUTPUT.findall(text)
            answer = (m[-1] if m else "").strip() + ("x" if wrong else "")
            reply = f"Done.\n```bash\nsubmit {answer}\n```"
        gen = self.tok.encode(reply)[: max_tokens - 1] + [self.tok.eos_id]
        return SimpleNamespace(
            text=self.tok.decode(gen[:-1]),
            token_ids=gen,
            finish_reason="stop",
            logprobs=[-0.5] * len(gen),
            token_versions=[self.version] * len(gen),
            weight_version=self.version,
        )


def lognormal(mean: float, cv: float, n: int, seed: int) -> np.ndarray:
    """`n` latencies with the given mean and coefficient of variation: the lognormal's
    quantiles at (i + 0.5) / n in a seeded random order, so that a few hundred episodes
    already show the distribution's CV and its stragglers (plain draws of a heavy tail
    scatter their CV widely at this size)."""
    sigma = math.sqrt(math.log1p(cv**2))
    mu = math.log(mean) - sigma**2 / 2
    z = [NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]
    return np.random.default_rng(seed).permutation(np.exp(mu + sigma * np.asarray(z)))


def cv(x) -> float:
    x = np.asarray(x, np.float64)
    return float(x.std() / x.mean())


def copy_state(state):
    return jax.tree.map(lambda x: x.copy(), state)


def rl_dummy_batch(rows: int, seq: int) -> dict[str, np.ndarray]:
    """An RL batch of the live shapes, every token trained (for compiling and calibration)."""
    batch, _ = build_rl_batch([], rows=rows, seq_len=seq, cfg=PolicyLossConfig(), version=0)
    rng = np.random.RandomState(0)
    batch["tokens"][:] = rng.randint(0, 256, (rows, seq))
    batch["targets"][:] = rng.randint(0, 256, (rows, seq))
    batch["loss_mask"][:] = batch["segment_ids"][:] = 1
    batch["positions"][:] = np.arange(seq)
    batch["behavior_logprobs"][:] = -0.5
    batch["advantages"][:] = rng.choice([-1.0, 1.0], (rows, 1))
    return batch


def calibrate(trainer: Trainer, rows: int, seq: int, tmp: Path, repeats: int = 2) -> float:
    """Seconds of one RL step as `rl_loop` runs it (step + export of the serving weights),
    after a compile step; the trainer's state is put back afterwards."""
    init = copy_state(trainer.state)
    batch = rl_dummy_batch(rows, seq)
    jax.block_until_ready(trainer.step(batch))
    trainer.export_serving(tmp / "warm")
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        trainer.step(batch)
        trainer.export_serving(tmp / f"calib{i}")  # pulls the params: waits for the step
        times.append(time.perf_counter() - start)
    trainer.state = init
    return float(np.median(times))


async def rl_arm(
    trainer: Trainer,
    init_state,
    staleness: int,
    a: SimpleNamespace,
    latencies: np.ndarray,
    wrong: np.ndarray,
    run_dir: Path,
) -> dict:
    """`a.steps` RL steps from `init_state` with staleness bound `staleness`; wall-clock from
    the first admitted episode to the last step's published weights."""
    trainer.state = copy_state(init_state)
    tok = ByteTokenizer()
    agent = StragglerAgent(latencies, wrong)
    publisher = InMemoryPublisher(on_publish=lambda path, v: setattr(agent, "version", v))
    ocfg = OrchestratorConfig(
        arm="real",
        group_size=a.group_size,
        batch_size=a.batch_size,
        max_staleness=staleness,
        max_context_tokens=a.seq_len,
        max_tokens_per_turn=128,
        max_concurrent_episodes=4 * a.batch_size,
        max_concurrent_real=4 * a.batch_size,
        seed=a.seed,
    )
    delivered, queue = [], asyncio.Queue()
    runner = RolloutRunner(
        ocfg,
        TERMINAL,
        ChatRenderer(tok),
        Backends(real=TextopsAnswerShell),
        client=agent,
        sinks=(delivered.append, queue.put_nowait),
    )
    tasks = generate_textops(TextopsConfig(num_tasks=64, seed=a.seed))
    buffer = RolloutBuffer(
        runner, tasks, steps=a.steps, seed=a.seed, queue=queue, batch_timeout_s=120.0
    )
    # As `simloop train-agent` starts: the initial weights are served as version 1.
    await publisher.publish(str(run_dir / "initial"), 1)
    start = time.perf_counter()
    await buffer.start(1)
    try:
        summary = await rl_loop(
            trainer,
            buffer,
            publisher,
            run_dir=run_dir,
            steps=a.steps,
            rows=a.batch_size,
            seq_len=a.seq_len,
            loss_cfg=PolicyLossConfig(),
            pad_id=tok.pad_id,
            base_version=1,
            publish_every=1,
            log_every=1,
            progress=False,
        )
    finally:
        await buffer.close()
    wall = time.perf_counter() - start
    hist = summary["history"]
    finished = [t for t in delivered if t.status == "ok"]
    agent_s = [sum(turn.timings["agent_s"] for turn in t.turns) for t in finished]
    return dict(
        max_staleness=staleness,
        steps=len(hist),
        wall_s=wall,
        s_per_step=wall / len(hist),
        data_wait_s=float(np.mean([h["data_wait_s"] for h in hist])),
        step_s=summary["step_s"] / len(hist),
        publish_s=summary["publish_s"] / len(hist),
        staleness_mean=float(np.mean([h["staleness_mean"] for h in hist])),
        staleness_max=max(h["staleness_max"] for h in hist),
        reward_mean=float(np.mean([h["reward_mean"] for h in hist])),
        truncated_rows=sum(h["truncated_rows"] for h in hist),
        episodes_started=agent.started,
        episodes_finished=len(finished),
        episode_agent_s_mean=float(np.mean(agent_s)),
        episode_agent_s_cv=cv(agent_s),
        published=publisher.version,
    )


def bench_rl(a: SimpleNamespace, console: Console) -> dict:
    trainer = Trainer(
        tiny(),
        OptimConfig(lr=1e-4, warmup_steps=0),
        total_steps=a.steps,
        loss="policy",
        loss_cfg=PolicyLossConfig(),
        valid_vocab=ByteTokenizer().vocab_size,
        seed=a.seed,
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        step_s = calibrate(trainer, a.batch_size, a.seq_len, tmp)
        mean = a.episode_mean_s if a.episode_mean_s is not None else a.latency_ratio * step_s
        n = (a.steps + 4) * a.batch_size  # more than either arm can start
        latencies = lognormal(mean, a.cv, n, a.seed)
        wrong = np.random.default_rng(a.seed + 1).random(n) < 0.3
        console.print(
            f"RL: tiny trainer step + export {step_s:.2f}s; episode latency lognormal "
            f"mean {mean:.2f}s, CV {a.cv} (drawn: mean {latencies.mean():.2f}s, CV "
            f"{cv(latencies):.2f}, max {latencies.max():.2f}s)"
        )
        init = copy_state(trainer.state)
        arms = {}
        for s in (0, a.staleness):
            with console.status(f"RL: {a.steps} steps, S={s}"):
                arms[s] = asyncio.run(rl_arm(trainer, init, s, a, latencies, wrong, tmp / f"s{s}"))
            r = arms[s]
            console.print(
                f"  S={s}: {r['wall_s']:.1f}s for {r['steps']} steps ({r['s_per_step']:.2f}s/step,"
                f" data wait {r['data_wait_s']:.2f}s/step, staleness max {r['staleness_max']},"
                f" reward {r['reward_mean']:.2f})"
            )
    sync, async_ = arms[0], arms[a.staleness]
    return {
        "calib_step_s": step_s,
        "episode_mean_s": mean,
        "cv_target": a.cv,
        "latency_cv_drawn": cv(latencies[: sync["episodes_started"]]),
        "latency_cv_measured": sync["episode_agent_s_cv"],
        "batch_size": a.batch_size,
        "group_size": a.group_size,
        "seq_len": a.seq_len,
        "sync": sync,
        "async": async_,
        "ratio": async_["wall_s"] / sync["wall_s"],
    }


# ----- report ----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and steps (smoke test)")
    parser.add_argument(
        "--sizes",
        nargs="+",
        choices=list(SIZES),
        help="models of the MFU part (default: all; --quick: tiny)",
    )
    parser.add_argument("--rl-steps", type=int, help="RL steps per arm (default 10; quick 3)")
    parser.add_argument("--batch-size", type=int, help="episodes per RL step (default 16; quick 8)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--staleness", type=int, default=2, help="S of the async arm")
    parser.add_argument("--cv", type=float, default=0.8, help="episode-latency CV (lognormal)")
    parser.add_argument("--episode-mean-s", type=float, help="mean episode latency (seconds)")
    parser.add_argument(
        "--latency-ratio", type=float, default=1.0, help="else: mean latency / the measured RL step"
    )
    parser.add_argument("--seed", type=int, default=0)
    add_json_flag(parser)
    args = parser.parse_args()
    q = args.quick
    sizes = args.sizes or (["tiny"] if q else list(SIZES))
    shapes = {"tiny": (8, 256, 5 if q else 10), "50m": (4, 256, 1 if q else 3)}  # rows, T, steps
    rl = SimpleNamespace(
        steps=args.rl_steps or (3 if q else 10),
        batch_size=args.batch_size or (8 if q else 16),
        group_size=args.group_size,
        staleness=args.staleness,
        cv=args.cv,
        episode_mean_s=args.episode_mean_s,
        latency_ratio=args.latency_ratio,
        seq_len=576,
        seed=args.seed,
    )

    console = Console()
    console.print(f"devices: {jax.devices()}")
    n_mm = 2048
    with console.status(f"float32 matmul peak ({n_mm}^3)"):
        peak = matmul_peak(n_mm, 5)
    console.print(
        f"peak: float32 {n_mm}x{n_mm} @ {n_mm}x{n_mm}, best of 5: {peak / 1e9:.1f} GFLOP/s"
    )
    trainers = []
    for name in sizes:
        rows, seq, steps = shapes[name]
        with console.status(f"trainer: {name} ({rows}x{seq}, {steps} steps)"):
            r = bench_trainer(name, rows, seq, steps, peak)
        trainers.append(r)
        console.print(
            f"  {name}: {r['params'] / 1e6:.2f}M params, compile+1st step "
            f"{r['compile_s']:.1f}s, {r['step_s']:.3f}s/step, "
            f"{r['tokens_per_s']:,.0f} tok/s, MFU {100 * r['mfu']:.1f}%"
        )
    rl_res = bench_rl(rl, console)

    s0, sa = rl_res["sync"], rl_res["async"]
    S = rl.staleness
    rows = [Row(f"float32 matmul peak {n_mm}^3", peak / 1e9, None, "GFLOP/s")]
    for r in trainers:
        label = f"{r['size']} ({r['params'] / 1e6:.1f}M) SFT {r['rows']}x{r['seq']}"
        rows += [
            Row(f"{label}: tokens/s", r["tokens_per_s"], None, "tokens/s"),
            Row(
                f"{label}: vs matmul peak (ratio = MFU)",
                r["flops_per_s"] / 1e9,
                peak / 1e9,
                "GFLOP/s",
            ),
        ]
    rows += [
        Row(f"RL {rl.steps} steps wall: S={S} vs S=0", sa["wall_s"], s0["wall_s"], "s", "<= 0.7x"),
        Row(f"RL data wait/step: S={S} vs S=0", sa["data_wait_s"], s0["data_wait_s"], "s"),
        Row(
            f"RL max staleness: S={S} vs S=0",
            sa["staleness_max"],
            s0["staleness_max"],
            "versions",
            f"<= {S} / 0",
        ),
        Row(
            "episode latency CV (measured, S=0)",
            rl_res["latency_cv_measured"],
            None,
            "",
            f"~{rl.cv}",
        ),
    ]
    console.print(table("simloop trainer (CPU): each row against a peer from this run", rows))
    console.print(f"model FLOPs per token: {FLOPS_FORMULA}; peak measured in this run.")
    console.print(
        f"RL: tiny policy trainer, {rl.batch_size} episodes/step (groups of {rl.group_size}), "
        f"rows of {rl.seq_len} tokens; {TURNS} agent turns per episode, episode latency "
        f"lognormal mean {rl_res['episode_mean_s']:.2f}s (= {rl.latency_ratio:g}x the measured "
        f"step + export of {rl_res['calib_step_s']:.2f}s unless --episode-mean-s); same seed, "
        f"tasks and latency sequence for both arms. S=0 waits every step for the slowest "
        f"episode of the batch; S={S} keeps sampling while the trainer steps."
    )
    if sa["staleness_max"] > S:
        console.print(
            f"[bold yellow]S={S} trained tokens {sa['staleness_max']} versions "
            "old[/]: the buffer takes groups in completion order, so a straggler "
            "admitted at version v can be overtaken and trained after v + S."
        )
    if rl_res["ratio"] > 0.7:
        console.print(
            f"[bold red]async/sync {rl_res['ratio']:.2f}x misses the 0.7x target[/]: "
            "episodes short against the trainer step, or the batch too small for "
            "stragglers to dominate; see --latency-ratio / --batch-size."
        )
    if args.json:
        detail = {
            "peak_flops": peak,
            "matmul_n": n_mm,
            "flops_formula": FLOPS_FORMULA,
            "trainer": trainers,
            "rl": rl_res,
        }
        write_json(args.json, "train_step", rows, detail)


if __name__ == "__main__":
    main()
