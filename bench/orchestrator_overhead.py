"""Orchestrator overhead: the real episode runner against an in-process zero-latency agent and
shell, so every microsecond measured is the orchestrator's own (rendering, token bookkeeping,
env parsing, metrics, admission).

    .venv/bin/python bench/orchestrator_overhead.py
    .venv/bin/python bench/orchestrator_overhead.py --episodes 2000 --turns 8

Prints per-turn overhead (target < 1 ms) and whether the largest concurrency level ran with all
its episodes in flight at once (target: 1000 concurrent episodes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

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
        self.cmd = self.tok.encode("Next step.\n\n```bash\necho ok\n```") + [self.tok.eos_id]
        self.submit = self.tok.encode("Done.\n\n```bash\nsubmit ok\n```") + [self.tok.eos_id]

    async def complete(self, prompt, *, max_tokens, **_):
        if self.hold is not None:
            await self.hold.wait()
        n = prompt.count(ByteTokenizer().token_id("<|im_start|>"))  # messages so far
        gen = self.cmd if n < 2 * self.turns - 1 else self.submit
        text = self.tok.decode(gen[:-1])
        return SimpleNamespace(text=text, token_ids=gen, finish_reason="stop",
                               logprobs=[-0.1] * len(gen), token_versions=[0] * len(gen),
                               weight_version=0)  # fmt: skip


async def measure(episodes: int, turns: int, concurrency: int) -> dict:
    tasks = generate_textops(TextopsConfig(num_tasks=episodes, seed=0))
    hold = asyncio.Event()
    agent = InstantAgent(turns, hold)
    cfg = OrchestratorConfig(arm="real", max_concurrent_episodes=concurrency,
                             max_concurrent_real=concurrency, max_context_tokens=16384,
                             seed=None)  # fmt: skip
    terminal = TerminalConfig(max_turns=turns + 1)
    runner = RolloutRunner(cfg, terminal, ChatRenderer(ByteTokenizer()),
                           Backends(real=lambda task: InstantShell()), client=agent)  # fmt: skip
    start = time.perf_counter()
    job = asyncio.create_task(runner.run(tasks), name="rollout")
    # Release the agent once every admitted episode is waiting on it: all in flight together.
    while runner.metrics.active < min(concurrency, episodes) and not job.done():
        await asyncio.sleep(0.001)
    peak_waiting = runner.metrics.active
    hold.set()
    trajs = await job
    elapsed = time.perf_counter() - start
    for t in trajs:
        validate(t)
    total_turns = sum(len(t.turns) for t in trajs)
    ok = sum(t.status == "ok" for t in trajs)
    return dict(episodes=episodes, concurrency=concurrency, turns=total_turns, ok=ok,
                wall_s=elapsed, ms_per_turn=1e3 * elapsed / total_turns,
                peak_active=runner.metrics.peak_active, all_in_flight=peak_waiting)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    console = Console()
    rows = []
    for concurrency in (1, 64, args.episodes):
        n = args.episodes if concurrency > 1 else min(100, args.episodes)
        with console.status(f"{n} episodes, {concurrency} concurrent"):
            rows.append(asyncio.run(measure(n, args.turns, concurrency)))
    table = Table(title="orchestrator overhead (zero-latency agent and shell)")
    for col in ("episodes", "concurrent", "turns", "ok", "wall s", "ms / turn", "peak in flight"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["episodes"]), str(r["concurrency"]), str(r["turns"]), str(r["ok"]),
                      f"{r['wall_s']:.2f}", f"{r['ms_per_turn']:.3f}",
                      str(r["peak_active"]))  # fmt: skip
    console.print(table)
    big = rows[-1]
    console.print(f"per-turn overhead at {big['concurrency']} concurrent: "
                  f"{big['ms_per_turn']:.3f} ms (target < 1 ms); episodes in flight at once: "
                  f"{big['peak_active']} (target 1000)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
