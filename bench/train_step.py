"""Trainer speed and async RL on this machine, each number against a peer from the same run:

1. trainer throughput and MFU: tokens/s of `Trainer.step` (SFT loss, steady state after the
   compile step) for the tiny and ~51M models; MFU = achieved model FLOP/s over the float32
   matmul peak measured at the start of the run;
2. async vs sync RL: wall-clock of the same RL steps through the real orchestrator
   (`RolloutRunner` + `RolloutBuffer` + `rl_loop` + a tiny policy-loss `Trainer` +
   `InMemoryPublisher`) with staleness S=2 against S=0. Fake agent servers take a per-episode
   latency drawn from a straggler-heavy lognormal (CV ~0.8); an in-memory shell keeps bash
   processes out of the measurement;
3. publish overlap: the wall of an RL step (`rl_loop`, one optimizer step + export + publish of
   the new version) with the export and publish overlapped with the next step
   (`overlap_publish`) against in line, publishing to a real `simloop serve` process (its
   `/admin/load_weights` reads, verifies and installs every version). Episodes come ready
   from memory (no data wait): the step and the publish are all there is to overlap.

    .venv/bin/python bench/train_step.py
    .venv/bin/python bench/train_step.py --quick      # smaller, for a smoke test
    .venv/bin/python bench/train_step.py --overlap-only              # part 3 alone (~1.5 min)
    .venv/bin/python bench/train_step.py --overlap-only --overlap-size tiny

Targets (docs/architecture.md §7): a compiled step with MFU reported against a measured peak; async
(S=2) wall-clock <= 0.7x sync (S=0) under straggler-heavy episode lengths. The overlap has no
target: its ideal is max(step, publish) per step against step + publish, and where trainer,
export and server share a few cores (here: 2) they slow each other down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import secrets
import shutil
import statistics
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
from launch.deploy.local import ADMIN_TOKEN_ENV, LocalServer
from rl.data import ByteTokenizer, ChatRenderer
from rl.data.rundir import CONFIG
from rl.data.tokenizer import IM_START
from rl.data.trajectory import Trajectory, Turn
from rl.model import save_hf
from rl.model.config import ModelConfig, tiny
from rl.model.publish import InMemoryPublisher
from rl.orchestrator.buffer import RolloutBuffer
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.runner import Backends, RolloutRunner
from rl.train.config import OptimConfig, PolicyLossConfig
from rl.train.loop import rl_loop
from rl.train.rollouts import InMemoryEpisodeSource, build_rl_batch
from rl.train.trainer import Trainer
from serving.client import ClientConfig, InferenceClient
from serving.publisher import EnginePublisher

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


# ----- 3. publishing overlapped with the next step -------------------------------------------


def ready_episodes(rows: int, seq: int, vocab: int, version: int, seed: int) -> list[Trajectory]:
    """`rows` finished episodes that fill rows of `seq` tokens (a 32-token prompt, then one
    generated reply sampled at `version`), in groups of 2 whose rewards differ, so every
    row trains."""
    rng = np.random.default_rng(seed)
    prompt, gen = 32, seq + 1 - 32
    out = []
    for i in range(rows):
        ids = rng.integers(0, vocab, prompt + gen).tolist()
        out.append(
            Trajectory(
                task_id=f"t{i // 2}",
                arm="closed_loop",
                env_backend="simulated",
                status="ok",
                reward=float(i % 2),
                group_id=f"g{i // 2}",
                turns=[Turn(agent_text="reply", command="ls", token_span=(prompt, prompt + gen))],
                source="sampler",
                token_ids=ids,
                loss_mask=[0] * prompt + [1] * gen,
                behavior_logprobs=[None] * prompt + [-1.0] * gen,
                policy_version=[None] * prompt + [version] * gen,
                tokenizer="byte",
            )
        )
    return out


@contextlib.asynccontextmanager
async def engine_server(cfg: ModelConfig, trainer: Trainer, root: Path):
    """A `simloop serve` process on the trainer's model, loading versions from under `root`;
    yields an `EnginePublisher` to it."""
    token = secrets.token_hex(16)
    hf_dir = save_hf(cfg, trainer.model(), root / "hf")
    (root / CONFIG).write_text("{}\n")  # defaults: the model comes from --model
    args = ["--model", str(hf_dir), "--model-name", "agent", "--checkpoint-root", str(root),
            "--num-slots", "1", "--max-seq-len", "64"]  # fmt: skip
    server = await asyncio.to_thread(
        LocalServer.start, "agent", root, extra_args=args, env={ADMIN_TOKEN_ENV: token}
    )
    client = InferenceClient(ClientConfig(server.url, model="agent", max_retries=0, timeout_s=600))
    try:
        yield EnginePublisher([client], token=token, retries=0)
    finally:
        await client.close()
        server.stop()


async def overlap_arms(a: SimpleNamespace, console: Console) -> dict:
    """Rounds of `a.overlap_steps` RL steps per arm (overlapped, in line; the order alternates
    round by round), each from the same initial state on the same batch, publishing to one
    server. Round 0 is a warm-up (the step's compile, the server's first loads into fresh
    memory) and is not counted; each arm's step wall is the median over the other rounds."""
    cfg = SIZES[a.overlap_size]
    rows, seq = a.overlap_rows, a.overlap_seq
    trainer = Trainer(
        cfg,
        OptimConfig(lr=1e-5, warmup_steps=0),
        total_steps=a.overlap_steps,
        loss="policy",
        loss_cfg=PolicyLossConfig(),
        valid_vocab=cfg.vocab_size,
        seed=a.seed,
    )
    init = copy_state(trainer.state)
    source = InMemoryEpisodeSource(lambda v: ready_episodes(rows, seq, cfg.vocab_size, v, a.seed))
    arms: dict[bool, list[dict]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="overlap-bench-") as tmp:
        root = Path(tmp)
        async with engine_server(cfg, trainer, root) as publisher:
            version = 1
            await source.set_version(version)
            for round_ in range(a.overlap_rounds + 1):
                for overlap in (True, False)[:: 1 if round_ % 2 else -1]:
                    trainer.state = copy_state(init)
                    start = time.perf_counter()
                    s = await rl_loop(
                        trainer,
                        source,
                        publisher,
                        run_dir=root,
                        steps=a.overlap_steps,
                        rows=rows,
                        seq_len=seq,
                        loss_cfg=PolicyLossConfig(),
                        pad_id=0,
                        base_version=version,
                        overlap_publish=overlap,
                        progress=False,
                    )
                    wall = time.perf_counter() - start
                    version += a.overlap_steps
                    hist = s["history"]
                    r = dict(
                        wall_s=wall,
                        step_wall_s=wall / len(hist),
                        step_s=s["step_s"] / len(hist),
                        export_s=float(np.mean([h["export_s"] for h in hist])),
                        load_s=float(np.mean([h["publish_load_s"] for h in hist])),
                        publish_total_s=s["publish_total_s"] / len(hist),
                        publish_wait_s=s["publish_s"] / len(hist),
                    )
                    if round_:
                        arms[overlap].append(r)
                    for old in (root / "weights").glob("v*"):  # served: 0.2 GB each at 50M
                        shutil.rmtree(old)
                    label = "overlapped" if overlap else "in line"
                    console.print(
                        f"  round {round_}{' (warm-up)' if not round_ else ''}, {label}: "
                        f"{r['step_wall_s']:.3f}s/step (step {r['step_s']:.3f}s, export "
                        f"{r['export_s']:.3f}s + load {r['load_s']:.3f}s, loop waited "
                        f"{r['publish_wait_s']:.3f}s on publishing)"
                    )

    def med(rs: list[dict]) -> dict:
        return {k: statistics.median(r[k] for r in rs) for k in rs[0]}

    return dict(
        size=a.overlap_size,
        params=cfg.num_params(),
        rows=rows,
        seq=seq,
        steps=a.overlap_steps,
        rounds=a.overlap_rounds,
        overlapped=med(arms[True]),
        in_line=med(arms[False]),
    )


# ----- report ----------------------------------------------------------------------------------


def throughput_and_rl(args: argparse.Namespace, console: Console) -> tuple[list[Row], dict, list]:
    """Parts 1 and 2: their rows, their JSON detail, and the notes to print under the table."""
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
    notes = [
        f"model FLOPs per token: {FLOPS_FORMULA}; peak measured in this run.",
        f"RL: tiny policy trainer, {rl.batch_size} episodes/step (groups of {rl.group_size}), "
        f"rows of {rl.seq_len} tokens; {TURNS} agent turns per episode, episode latency "
        f"lognormal mean {rl_res['episode_mean_s']:.2f}s (= {rl.latency_ratio:g}x the measured "
        f"step + export of {rl_res['calib_step_s']:.2f}s unless --episode-mean-s); same seed, "
        f"tasks and latency sequence for both arms. S=0 waits every step for the slowest "
        f"episode of the batch; S={S} keeps sampling while the trainer steps.",
    ]
    if sa["staleness_max"] > S:
        notes.append(
            f"[bold yellow]S={S} trained tokens {sa['staleness_max']} versions "
            "old[/]: the buffer takes groups in completion order, so a straggler "
            "admitted at version v can be overtaken and trained after v + S (by one more "
            "while the previous version is still being published: overlap_publish)."
        )
    if rl_res["ratio"] > 0.7:
        notes.append(
            f"[bold red]async/sync {rl_res['ratio']:.2f}x misses the 0.7x target[/]: "
            "episodes short against the trainer step, or the batch too small for "
            "stragglers to dominate; see --latency-ratio / --batch-size."
        )
    detail = {
        "peak_flops": peak,
        "matmul_n": n_mm,
        "flops_formula": FLOPS_FORMULA,
        "trainer": trainers,
        "rl": rl_res,
    }
    return rows, detail, notes


def publish_overlap(args: argparse.Namespace, console: Console) -> tuple[list[Row], dict, list]:
    """Part 3: its rows, its JSON detail, and the notes to print under the table."""
    q = args.quick
    ov = SimpleNamespace(
        overlap_size=args.overlap_size or ("tiny" if q else "50m"),
        overlap_rows=args.overlap_rows,
        overlap_seq=args.overlap_seq,
        overlap_steps=args.overlap_steps or (3 if q else 6),
        overlap_rounds=args.overlap_rounds or (1 if q else 2),
        seed=args.seed,
    )
    console.print(
        f"publish overlap: {ov.overlap_size} policy trainer, {ov.overlap_rows}x{ov.overlap_seq} "
        f"rows, {ov.overlap_steps} steps per arm, {ov.overlap_rounds} rounds after a warm-up, "
        "publishing to a simloop serve process"
    )
    res = asyncio.run(overlap_arms(ov, console))
    o, n = res["overlapped"], res["in_line"]
    label = f"{res['size']} ({res['params'] / 1e6:.1f}M) {res['rows']}x{res['seq']}"
    rows = [
        Row(
            f"RL step wall, {label}: publish overlapped vs in line",
            o["step_wall_s"],
            n["step_wall_s"],
            "s",
            ratio_of="peer/ours",
        ),
        Row(
            f"RL loop's wait on publishing/step, {label}: overlapped vs in line",
            o["publish_wait_s"],
            n["publish_wait_s"],
            "s",
            ratio_of="peer/ours",
        ),
    ]
    ideal = max(n["step_s"], n["publish_total_s"])
    notes = [
        f"publish overlap: in line a step is its optimizer step ({n['step_s']:.3f}s) + export "
        f"({n['export_s']:.3f}s) + the server's load ({n['load_s']:.3f}s); overlapped, the "
        f"ideal is the longer of step and export + load ({ideal:.3f}s, "
        f"{n['step_wall_s'] / ideal:.2f}x), less what trainer, export and server take from "
        f"each other on {os.cpu_count()} CPU(s) (overlapped: step {o['step_s']:.3f}s, export "
        f"{o['export_s']:.3f}s, load {o['load_s']:.3f}s)."
    ]
    return rows, {"publish_overlap": res}, notes


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
    parser.add_argument(
        "--overlap-only", action="store_true", help="part 3 (publish overlap) alone"
    )
    parser.add_argument(
        "--overlap-size", choices=list(SIZES), help="part 3's model (default 50m; quick: tiny)"
    )
    parser.add_argument("--overlap-rows", type=int, default=2, help="part 3's episodes per step")
    parser.add_argument("--overlap-seq", type=int, default=128, help="part 3's row length")
    parser.add_argument(
        "--overlap-steps", type=int, help="part 3's steps per arm (default 6; quick 3)"
    )
    parser.add_argument(
        "--overlap-rounds", type=int, help="part 3's timed rounds per arm (default 2; quick 1)"
    )
    parser.add_argument("--seed", type=int, default=0)
    add_json_flag(parser)
    args = parser.parse_args()
    for flag in ("overlap_rows", "overlap_seq", "overlap_steps", "overlap_rounds"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} {value} is invalid: >= 1")
    if args.overlap_seq <= 32:
        parser.error(f"--overlap-seq {args.overlap_seq} is invalid: > 32 (the prompt's length)")

    console = Console()
    console.print(f"devices: {jax.devices()}")
    rows, detail, notes = [], {}, []
    if not args.overlap_only:
        rows, detail, notes = throughput_and_rl(args, console)
    more_rows, more_detail, more_notes = publish_overlap(args, console)
    rows, notes = rows + more_rows, notes + more_notes
    detail.update(more_detail)
    console.print(table("simloop trainer (CPU): each row against a peer from this run", rows))
    for note in notes:
        console.print(note)
    if args.json:
        write_json(args.json, "train_step", rows, detail)


if __name__ == "__main__":
    main()
