"""Orchestrator overhead: the real episode runner against an in-process zero-latency agent and
shell, so every microsecond measured is the orchestrator's own (rendering, token bookkeeping,
env parsing, metrics, admission).

    .venv/bin/python bench/orchestrator_overhead.py                  # 10,000 in flight at once
    .venv/bin/python bench/orchestrator_overhead.py --episodes 100 --turns 3   # a smoke test

Prints per-turn overhead at 1, 64 and `--episodes` concurrent episodes (target < 0.2 ms at
10,000), whether the largest level had all its episodes in flight at once (target 10,000), and
its memory: the process's peak RSS (`resource.getrusage` ru_maxrss) and the RSS per episode in
flight: the growth of the resident set (/proc/self/statm) over that level, all its trajectories
still held at the end, divided by its episodes (it runs first, so little freed memory is reused).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from results import Row, add_json_flag, table, write_json  # bench/ is on sys.path
from rich.console import Console
from rich.table import Table

from envs.config import TerminalConfig, TextopsConfig
from envs.shell import Observation, ShellLifecycle
from envs.textops import generate_textops
from rl.data import ByteTokenizer, ChatRenderer
from rl.data.trajectory import validate
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.runner import Backends, RolloutRunner


class InstantShell(ShellLifecycle):
    async def run(self, command: str, timeout_s: float) -> Observation:
        return Observation(output="ok", exit_code=0)

    async def close(self) -> None:
        pass


class InstantAgent:
    """Replies at once: `turns - 1` commands, then a submit. Holds every episode at the same
    turn for a moment (`hold`) so that all of them are in flight together."""

    def __init__(self, turns: int, hold: asyncio.Event | None = None):
        self.tok = ByteTokenizer()
        self.turns, self.hold = turns, hold
        self.im_start = self.tok.token_id("<|im_start|>")
        self.cmd = self.tok.encode("Next step.\n\n```bash\necho ok\n```") + [self.tok.eos_id]
        self.submit = self.tok.encode("Done.\n\n```bash\nsubmit ok\n```") + [self.tok.eos_id]

    async def complete(self, prompt, *, max_tokens, **_):
        if self.hold is not None:
            await self.hold.wait()
        n = prompt.count(self.im_start)  # messages so far
        gen = self.cmd if n < 2 * self.turns - 1 else self.submit
        text = self.tok.decode(gen[:-1])
        return SimpleNamespace(
            text=text,
            token_ids=gen,
            finish_reason="stop",
            logprobs=[-0.1] * len(gen),
            token_versions=[0] * len(gen),
            weight_version=0,
        )


def peak_rss_bytes() -> int:
    """This process's peak resident set so far: ru_maxrss (KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_bytes() -> int:
    """This process's resident set now: /proc/self/statm on Linux, else the peak so far."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return peak_rss_bytes()
    return pages * os.sysconf("SC_PAGE_SIZE")


async def measure(tasks: list, turns: int, concurrency: int) -> dict:
    hold = asyncio.Event()
    agent = InstantAgent(turns, hold)
    cfg = OrchestratorConfig(
        arm="real",
        max_concurrent_episodes=concurrency,
        max_concurrent_real=concurrency,
        max_context_tokens=16384,
        seed=None,
    )
    terminal = TerminalConfig(max_turns=turns + 1)
    runner = RolloutRunner(
        cfg,
        terminal,
        ChatRenderer(ByteTokenizer()),
        Backends(real=lambda task: InstantShell()),
        client=agent,
    )
    episodes = len(tasks)
    rss_before = rss_bytes()
    start = time.perf_counter()
    job = asyncio.create_task(runner.run(tasks), name="rollout")
    # Release the agent once every admitted episode is waiting on it: all in flight together.
    while runner.metrics.active < min(concurrency, episodes) and not job.done():
        await asyncio.sleep(0.001)
    peak_waiting = runner.metrics.active
    hold.set()
    trajs = await job
    elapsed = time.perf_counter() - start
    rss_held = rss_bytes()  # every trajectory still held: each episode's state at its end
    for t in trajs:
        validate(t)
    total_turns = sum(len(t.turns) for t in trajs)
    ok = sum(t.status == "ok" for t in trajs)
    return dict(
        episodes=episodes,
        concurrency=concurrency,
        turns=total_turns,
        ok=ok,
        wall_s=elapsed,
        ms_per_turn=1e3 * elapsed / total_turns,
        peak_active=runner.metrics.peak_active,
        all_in_flight=peak_waiting,
        rss_peak_bytes=peak_rss_bytes(),
        rss_per_episode_bytes=(rss_held - rss_before) / episodes,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--episodes",
        type=int,
        default=10_000,
        help="episodes of the largest level, all in flight at once",
    )
    parser.add_argument("--turns", type=int, default=5, help="agent replies per episode")
    add_json_flag(parser)
    args = parser.parse_args()
    for flag, value in (("--episodes", args.episodes), ("--turns", args.turns)):
        if value < 1:
            parser.error(f"{flag} {value} is invalid: >= 1")
    console = Console()
    n = args.episodes
    # The largest level first, so that its RSS growth is its own (the others' freed memory
    # would be reused); its tasks are made beforehand. A few episodes before it warm up what
    # runs once per process (imports, regexes).
    asyncio.run(measure(generate_textops(TextopsConfig(num_tasks=8, seed=1)), args.turns, 8))
    rows = []
    for episodes, concurrency in [(n, n), (min(100, n), 1), (n, 64)]:
        tasks = generate_textops(TextopsConfig(num_tasks=episodes, seed=0))
        with console.status(f"{episodes} episodes, {concurrency} concurrent"):
            rows.append(asyncio.run(measure(tasks, args.turns, concurrency)))
    big = rows[0]
    rows.sort(key=lambda r: r["concurrency"])
    detail = Table(title="orchestrator overhead (zero-latency agent and shell)")
    for col in ("episodes", "concurrent", "turns", "ok", "wall s", "ms / turn", "peak in flight"):
        detail.add_column(col, justify="right")
    for r in rows:
        detail.add_row(
            str(r["episodes"]),
            str(r["concurrency"]),
            str(r["turns"]),
            str(r["ok"]),
            f"{r['wall_s']:.2f}",
            f"{r['ms_per_turn']:.3f}",
            str(r["peak_active"]),
        )
    console.print(detail)
    results = [
        Row(
            f"overhead per turn, {r['concurrency']:,} in flight",
            r["ms_per_turn"],
            None,
            "ms",
            "< 0.2 ms" if r is big else None,
        )
        for r in rows
    ] + [
        Row("episodes in flight at once", big["peak_active"], None, "episodes", 10_000),
        Row("peak RSS (ru_maxrss)", big["rss_peak_bytes"] / 2**20, None, "MiB"),
        Row("RSS per episode in flight", big["rss_per_episode_bytes"] / 2**10, None, "KiB"),
    ]
    console.print(table("orchestrator at scale: overhead and memory", results))
    console.print(
        f"{args.turns} turns per episode; RSS per episode = growth of the resident set over the "
        f"{big['concurrency']:,}-in-flight level (its trajectories held) / its episodes."
    )
    if args.json:
        write_json(args.json, "orchestrator_overhead", results, rows)


if __name__ == "__main__":
    main()
