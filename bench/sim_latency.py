"""Simulator latency by concurrency and turn depth (issue 58): the requests the simulated shell
sends, built from real histories, against any simulator server, at concurrency {1, 2, 4, 8} x
turn depth {1, 5, 10, 20, 35}, three trials per cell.

    .venv/bin/python bench/sim_latency.py           # a tiny server of its own: 3-4 min, 2 CPUs
    .venv/bin/python bench/sim_latency.py --concurrency 1,2 --depths 1,5 --trials 1
    .venv/bin/python bench/sim_latency.py --url http://127.0.0.1:8000       # any running server
    .venv/bin/python bench/sim_latency.py --url http://h1:8000 http://h2:8000  # a ReplicaPool
    .venv/bin/python bench/sim_latency.py --json sim_latency.json

A request at depth d is what `envs.simulated.SimulatedShell` sends for a history's command
d + 1 after its first d (command, observation) turns: the bench hands the shell those turns
and calls `run` (`rl.data.sim_format` rendering, token ids from `--tokenizer`, the end-of-turn
token as the stop, `POST /v1/completions`), so it speaks to `simloop serve`, a pool, vLLM and
its fake (`serving.vllm.fake_server`) alike.

Histories (real observations only), interleaved so that a cell draws on every source:
imported SWE-agent trajectories (`--swe-dir`, default `../shared/data/swe-agent-trajectories`
beside the checkout, left out with a note when absent; SWE-agent records no return codes: 0
stands in, as `simloop train-sim` trains on) and collected episodes: `--trajectories PATH...`
(simloop JSONL, e.g. of `simloop collect --collect.style explore`), or else `--collect N`
textops `explore` episodes (default 8) that the bench runs itself in the real shell
(`envs.local.LocalShell`), one command more than the deepest depth. The SWE-agent trajectories
hold at most 18 commands, so depths 20 and 35 draw on collected episodes alone. At depth d a
history with no command after d turns is skipped (never padded, never used shorter), and a
depth no history reaches is a row saying "none this deep"; a cell that asks for more requests
than a depth has histories uses them again (each still its own prompt, by its tag: below).
The table's `from` column says which sources each cell drew on.

The context is the server's (`max_model_len` of `/v1/models`; the server this bench starts
holds `--context`, default 4096, the tiny preset's positions). As the simulated shell does
with `max_context_tokens`, a prompt keeps its system prompt (role, task, starting files) and
its command, and whole oldest turns go until it fits the context less `--max-tokens`
(`sim_format.kept_history`): the table reports the turns each cell's prompts kept and their
mean length, so a depth past what the context holds shows as fewer turns kept. A history
whose prompt does not fit even without turns is skipped at that depth.

Per cell and trial, `concurrency` requests are sent at once; each generates up to
`--max-tokens` (default 64; sampled at `--temperature`, seeded). Reported per cell, over its
trials: the mean wall to clear (first request sent to last answer, and its range), tokens/s
per request (its generated tokens over its own wall, mean over requests), aggregate tokens/s
(every generated token over the summed trial walls; in the JSON its peer is the same depth at
concurrency 1, so the ratio is what batching bought) and cap hits (`finish_reason ==
"length"`: no end-of-turn within `--max-tokens`, the runaway the simulated shell flags
`cap_hit`). A random-weight tiny model seldom says end-of-turn, so most requests hit the cap.

Each request's system prompt starts with its own tag (8 hex digits of a hash), so that no
request finds another's KV in a server's prefix cache (simloop's prefix reuse, vLLM's prefix
caching) and every cell measures full prefills, as a stateless call whose history was cut to
the context pays. One untimed warm-up trial at the largest concurrency runs first.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from results import Row, add_json_flag, positive, write_json  # bench/ is on sys.path
from rich.console import Console
from rich.table import Table

from envs.config import SimulatedShellConfig, TextopsConfig
from envs.shell import Observation, TaskSetup
from envs.simulated import SimulatedShell
from rl.data.chat import ChatRenderer
from rl.data.sim_format import SIM_SYSTEM_PROMPT, render_sim_messages
from rl.data.tokenizer import ByteTokenizer, Tokenizer, hf_dir_tokenizer
from serving.client import ClientConfig, ClientError, InferenceClient

REPO = Path(__file__).resolve().parents[1]
SWE_DIR = REPO.parent / "shared" / "data" / "swe-agent-trajectories"
CONCURRENCY = (1, 2, 4, 8)
DEPTHS = (1, 5, 10, 20, 35)
CONTEXT = 4096
"""The started server's context: the tiny preset's positions."""


def tag(seed: int, n: int) -> str:
    """What starts request `n`'s system prompt: 8 hex digits of a hash, so two requests'
    prompts part within the first characters (no server finds another's KV to reuse)."""
    return f"[{hashlib.blake2b(f'{seed}:{n}'.encode(), digest_size=4).hexdigest()}] "


@dataclass(frozen=True)
class History:
    """One episode's real turns, as the simulated shell would hold them."""

    source: str
    """`swe-agent` or `collected`."""
    name: str
    instruction: str
    setup_files: dict[str, str]
    turns: list[tuple[str, Observation]]
    """(command, real observation), in order."""


@dataclass
class Cell:
    """One (depth, concurrency) cell: its requests, trial by trial."""

    depth: int
    concurrency: int
    trials: list[dict] = field(default_factory=list)
    """Per trial: `wall_s` (to clear) and `requests`: each one's `wall_s`, `tokens`,
    `cap_hit`, `prompt_tokens`, `kept_turns`, `source`, `history`."""
    skipped: str | None = None
    """Why the cell did not run (no history reaches its depth)."""

    def requests(self) -> list[dict]:
        return [r for t in self.trials for r in t["requests"]]

    def summary(self) -> dict[str, Any]:
        reqs = self.requests()
        if not reqs:
            return {"depth": self.depth, "concurrency": self.concurrency, "skipped": self.skipped}
        walls = [t["wall_s"] for t in self.trials]
        tokens = sum(r["tokens"] for r in reqs)
        sources = sorted({r["source"] for r in reqs})
        return {
            "depth": self.depth,
            "concurrency": self.concurrency,
            "trials": len(self.trials),
            "requests": len(reqs),
            "wall_s": statistics.fmean(walls),
            "wall_s_min": min(walls),
            "wall_s_max": max(walls),
            "request_wall_s": statistics.fmean(r["wall_s"] for r in reqs),
            "tokens_per_s_request": statistics.fmean(r["tokens"] / r["wall_s"] for r in reqs),
            "tokens_per_s_aggregate": tokens / sum(walls),
            "tokens": tokens,
            "cap_hits": sum(r["cap_hit"] for r in reqs),
            "prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in reqs),
            "prompt_tokens_max": max(r["prompt_tokens"] for r in reqs),
            "kept_turns": statistics.fmean(r["kept_turns"] for r in reqs),
            "sources": sources,
            "skipped": None,
        }


# ----- histories ---------------------------------------------------------------------------------


def swe_histories(folder: Path) -> list[History]:
    """Every SWE-agent trajectory under `folder` that imports (failures are reported)."""
    from rl.data.importers import import_files

    report = import_files([folder], "swe-agent")
    for path, why in report.failed:
        print(f"sim_latency: skipped {path}: {why}", file=sys.stderr)
    return [history_of(traj, "swe-agent", path.stem) for path, traj in report.imported]


def file_histories(paths: list[str]) -> list[History]:
    """Collected episodes from simloop JSONL files or folders; the simulator's own (a
    simulated shell's observations) are left out."""
    from rl.data.trajectory import load_trajectories

    out = []
    for i, traj in enumerate(load_trajectories(paths)):
        if traj.env_backend != "simulated":
            out.append(history_of(traj, "collected", traj.task_id or f"episode-{i}"))
    return out


def history_of(traj, source: str, name: str) -> History:
    """A trajectory's turns that ran a command; a missing return code reads 0 (what
    `rl.data.datasets.sim_sft_examples` trains on by default)."""
    turns = [
        (t.command, Observation(t.observation, 0 if t.exit_code is None else t.exit_code))
        for t in traj.turns
        if t.command is not None and t.observation is not None
    ]
    return History(source, name, traj.instruction, dict(traj.setup_files), turns)


async def collect_histories(episodes: int, commands: int, seed: int) -> list[History]:
    """`episodes` textops tasks, each run as `commands` commands of the scripted `explore`
    solver in a real shell: long sessions of real, short observations."""
    from envs.local import LocalShell
    from envs.textops import TextopsSolver, generate_textops

    tasks = generate_textops(TextopsConfig(num_tasks=episodes, seed=seed))

    async def one(task) -> History:
        turns = []
        async with LocalShell(None, TaskSetup(files=dict(task.setup.files))) as shell:
            for command in TextopsSolver(task, "explore", commands=commands).plan:
                turns.append((command, await shell.run(command, timeout_s=10.0)))
        return History("collected", task.id, task.instruction, dict(task.setup.files), turns)

    return list(await asyncio.gather(*(one(t) for t in tasks)))


def interleave(*groups: list[History]) -> list[History]:
    """One of each group in turn, so that the first few of any depth mix the sources."""
    out = []
    for i in range(max((len(g) for g in groups), default=0)):
        out += [g[i] for g in groups if i < len(g)]
    return out


# ----- requests ----------------------------------------------------------------------------------


@dataclass
class Bench:
    """What every request shares: the client, the renderer, the context and sampling."""

    client: Any
    """An `InferenceClient` or a `ReplicaPool`."""
    renderer: ChatRenderer
    context: int
    """The server's context per sequence (prompt + generation)."""
    max_tokens: int
    temperature: float
    seed: int
    timeout_s: float
    sent: int = 0
    """Requests sent so far (each one's tag and seed)."""

    def shell_config(self, n: int) -> SimulatedShellConfig:
        return SimulatedShellConfig(
            max_tokens=self.max_tokens,
            max_context_tokens=self.context,
            temperature=self.temperature,
            seed=self.seed * 1_000_003 + n,
            system_prompt=tag(self.seed, n) + SIM_SYSTEM_PROMPT,
            request_timeout_s=self.timeout_s,
        )

    def fits(self, h: History, depth: int) -> bool:
        """Whether `h` has a command after `depth` turns whose prompt fits without history."""
        if len(h.turns) <= depth:
            return False
        cfg = self.shell_config(0)
        messages = render_sim_messages(
            h.instruction,
            [],
            h.turns[depth][0],
            setup_files=h.setup_files,
            system_prompt=cfg.system_prompt,
        )
        ids = self.renderer.render(messages, add_generation_prompt=True, enable_thinking=False)
        return len(ids) <= cfg.prompt_budget

    async def request(self, h: History, depth: int) -> dict:
        """The simulated shell's request for `h`'s command `depth + 1` after its first `depth`
        turns; its wall and what came back."""
        n, self.sent = self.sent, self.sent + 1
        shell = SimulatedShell(
            self.client,
            task_instruction=h.instruction,
            setup=TaskSetup(files=dict(h.setup_files)),
            config=self.shell_config(n),
            renderer=self.renderer,
        )
        shell.history = list(h.turns[:depth])
        began = time.perf_counter()
        obs = await shell.run(h.turns[depth][0], timeout_s=self.timeout_s)
        wall = time.perf_counter() - began
        return {
            "wall_s": wall,
            "tokens": obs.info["completion_tokens"],
            "cap_hit": obs.info["cap_hit"],
            "prompt_tokens": obs.info["prompt_tokens"],
            "kept_turns": depth - obs.info.get("history_dropped", 0),
            "source": h.source,
            "history": h.name,
        }

    async def trial(self, pool: list[History], depth: int, concurrency: int, offset: int) -> dict:
        """`concurrency` requests at once, from `pool[offset:]` (wrapping around)."""
        picks = [pool[(offset + i) % len(pool)] for i in range(concurrency)]
        began = time.perf_counter()
        done = await asyncio.gather(*(self.request(h, depth) for h in picks))
        return {"wall_s": time.perf_counter() - began, "requests": list(done)}


async def measure(
    bench: Bench, histories: list[History], args, console: Console
) -> tuple[dict | None, list[Cell]]:
    """(the warm-up trial, every cell): depth by depth, `args.trials` trials each
    (consecutive trials start at different histories)."""
    pools = {d: [h for h in histories if bench.fits(h, d)] for d in args.depths}
    cells: list[Cell] = []
    warm, warmup = next((d for d in args.depths if pools[d]), None), None
    if warm is not None:
        with console.status(f"warm-up: {max(args.concurrency)} requests at depth {warm}"):
            warmup = await bench.trial(pools[warm], warm, max(args.concurrency), 0)
    for depth in args.depths:
        for c in args.concurrency:
            cell = Cell(depth, c)
            cells.append(cell)
            if not pools[depth]:
                cell.skipped = "none this deep"
                continue
            for t in range(args.trials):
                what = f"depth {depth} x {c} concurrent, trial {t + 1}/{args.trials}"
                with console.status(what):
                    cell.trials.append(await bench.trial(pools[depth], depth, c, t * c))
            s = cell.summary()
            console.print(
                f"depth {depth:>2} x {c}: {s['wall_s']:.2f} s to clear, "
                f"{s['tokens_per_s_aggregate']:,.0f} tokens/s, {s['cap_hits']}/{s['requests']} "
                "cap hits"
            )
    return warmup, cells


# ----- server and client -------------------------------------------------------------------------


async def server_info(urls: list[str], timeout_s: float) -> tuple[str, int]:
    """(model name, context) from each server's `/v1/models`: the first's name, the smallest
    `max_model_len`."""
    names, contexts = [], []
    for url in urls:
        async with InferenceClient(ClientConfig(url, timeout_s=timeout_s, max_retries=0)) as c:
            try:
                body, _ = await c.request("GET", "/v1/models")
            except ClientError as e:  # the wrong URL, or no server there: say so, no traceback
                raise SystemExit(f"sim_latency: no simulator server answers at {url}: {e}") from e
        model = body["data"][0]
        if not isinstance(model.get("max_model_len"), int):
            raise RuntimeError(f"{url}/v1/models gives no max_model_len: {model}")
        names.append(model["id"])
        contexts.append(model["max_model_len"])
    return names[0], min(contexts)


def open_client(urls: list[str], model: str, timeout_s: float):
    cfg = ClientConfig(urls[0], model=model, timeout_s=timeout_s, max_connections=1024)
    if len(urls) == 1:
        return InferenceClient(cfg)
    from serving.pool import ReplicaPool

    return ReplicaPool(urls, role="simulator", client_config=cfg)


def load_tokenizer(spec: str) -> Tokenizer:
    return ByteTokenizer() if spec == "byte" else hf_dir_tokenizer(spec)


async def run(urls: list[str], histories: list[History], args, console: Console) -> dict:
    """The whole measurement against running servers: the cells and what the table needs."""
    model, context = await server_info(urls, args.timeout_s)
    if context <= args.max_tokens:
        raise SystemExit(
            f"sim_latency: --max-tokens {args.max_tokens} leaves no room for a prompt in the "
            f"server's context of {context}"
        )
    async with AsyncExitStack() as stack:
        client = await stack.enter_async_context(open_client(urls, model, args.timeout_s))
        bench = Bench(
            client,
            ChatRenderer(load_tokenizer(args.tokenizer)),
            context,
            args.max_tokens,
            args.temperature,
            args.seed,
            args.timeout_s,
        )
        began = time.perf_counter()
        warmup, cells = await measure(bench, histories, args, console)
        wall = time.perf_counter() - began
    return {
        "urls": urls,
        "model": model,
        "context": context,
        "wall_s": wall,
        "warmup": warmup,
        "cells": cells,
    }


# ----- report ------------------------------------------------------------------------------------


SOURCE_NAMES = {"swe-agent": "swe", "collected": "coll"}


def report_table(done: dict, args) -> Table:
    """One row per cell, grouped by depth."""
    t = Table(
        title=f"simulator latency: {done['model']} at {', '.join(done['urls'])}; context "
        f"{done['context']}, prompts cut to {done['context'] - args.max_tokens} (oldest turns "
        f"first); max_tokens {args.max_tokens}; {args.trials} trial(s) per cell"
    )
    cols = (
        "depth",
        "conc",
        "reqs",
        "from",
        "turns kept",
        "prompt tokens",
        "clear s",
        "(min-max)",
        "tok/s per req",
        "tok/s all",
        "cap hits",
    )
    for col in cols:
        t.add_column(col, justify="left" if col == "from" else "right")
    last = None
    for cell in done["cells"]:
        s = cell.summary()
        if last is not None and cell.depth != last:
            t.add_section()
        last = cell.depth
        if s["skipped"]:
            t.add_row(str(cell.depth), str(cell.concurrency), "0", s["skipped"], *["-"] * 7)
            continue
        t.add_row(
            str(cell.depth),
            str(cell.concurrency),
            str(s["requests"]),
            "+".join(SOURCE_NAMES.get(x, x) for x in s["sources"]),
            f"{s['kept_turns']:.1f}",
            f"{s['prompt_tokens']:,.0f}",
            f"{s['wall_s']:.2f}",
            f"{s['wall_s_min']:.2f}-{s['wall_s_max']:.2f}",
            f"{s['tokens_per_s_request']:,.0f}",
            f"{s['tokens_per_s_aggregate']:,.0f}",
            f"{s['cap_hits']}/{s['requests']}",
        )
    return t


def rows_of(cells: list[Cell]) -> list[Row]:
    """The common JSON shape: per cell, wall to clear, tokens/s per request and in aggregate
    (peer: the same depth at concurrency 1), cap hits."""
    sums = {(c.depth, c.concurrency): c.summary() for c in cells}
    rows = []
    for (depth, conc), s in sums.items():
        if s["skipped"]:
            continue
        one = sums.get((depth, 1), {})
        where = f"depth {depth}, {conc} concurrent"
        rows += [
            Row(f"wall to clear, {where}", s["wall_s"], None, "s"),
            Row(f"tokens/s per request, {where}", s["tokens_per_s_request"], None, "tokens/s"),
            Row(
                f"tokens/s aggregate, {where} vs 1 at a time",
                s["tokens_per_s_aggregate"],
                None if conc == 1 or one.get("skipped", True) else one["tokens_per_s_aggregate"],
                "tokens/s",
            ),
            Row(f"cap hits, {where}", s["cap_hits"], None, f"of {s['requests']} requests"),
        ]
    return rows


# ----- entry point -------------------------------------------------------------------------------


def int_list(value: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value.split(","))
    except ValueError:
        out = ()
    if not out or any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(
            f"{value!r} is invalid: comma-separated positive integers, e.g. 1,2,4"
        )
    return tuple(dict.fromkeys(out))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--url",
        nargs="+",
        metavar="URL",
        help="running simulator server(s) (several: a ReplicaPool); default: start "
        "`simloop serve --preset tiny` here",
    )
    p.add_argument(
        "--concurrency",
        type=int_list,
        default=CONCURRENCY,
        metavar="N,N",
        help="requests in flight at once (default 1,2,4,8)",
    )
    p.add_argument(
        "--depths",
        type=int_list,
        default=DEPTHS,
        metavar="D,D",
        help="turns of history before the command (default 1,5,10,20,35)",
    )
    p.add_argument("--trials", type=positive, default=3, help="trials per cell (default 3)")
    p.add_argument("--max-tokens", type=positive, default=64, help="per request (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="seeds sampling and collected tasks")
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="'byte' (simloop's tiny models) or an HF tokenizer directory / "
        "tokenizer.json: the server's (default byte)",
    )
    p.add_argument(
        "--context",
        type=positive,
        default=CONTEXT,
        help=f"the started server's context per sequence (default {CONTEXT})",
    )
    p.add_argument(
        "--swe-dir",
        type=Path,
        default=SWE_DIR,
        help=f"SWE-agent .traj files (default {SWE_DIR}; skipped when absent)",
    )
    p.add_argument("--no-swe", action="store_true", help="leave the SWE-agent trajectories out")
    p.add_argument(
        "--trajectories",
        nargs="+",
        metavar="PATH",
        help="collected episodes (simloop JSONL files or folders) instead of "
        "collecting textops episodes here",
    )
    p.add_argument(
        "--collect",
        type=int,
        default=8,
        metavar="N",
        help="textops episodes to collect in the real shell when no "
        "--trajectories are given (default 8; 0: none)",
    )
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request (default 600)")
    add_json_flag(p)
    args = p.parse_args(argv)
    if args.collect < 0:
        p.error(f"--collect {args.collect} is invalid: >= 0")
    if args.seed < 0:
        p.error(f"--seed {args.seed} is invalid: >= 0")
    if not args.temperature >= 0:
        p.error(f"--temperature {args.temperature} is invalid: >= 0")
    tok = Path(args.tokenizer)
    if args.tokenizer != "byte" and not (tok.is_file() or (tok / "tokenizer.json").is_file()):
        p.error(f"--tokenizer {args.tokenizer!r}: no tokenizer.json there ('byte' or an HF one)")
    return args


async def load_histories(args, console: Console) -> tuple[list[History], list[str]]:
    """The histories and a line per source (what was used, or why not)."""
    swe: list[History] = []
    notes = []
    if args.no_swe:
        notes.append("SWE-agent trajectories: left out (--no-swe)")
    elif args.swe_dir.is_dir():
        swe = swe_histories(args.swe_dir)
        notes.append(f"SWE-agent trajectories: {len(swe)} from {args.swe_dir}")
    else:
        notes.append(f"SWE-agent trajectories: none ({args.swe_dir} is absent)")
    if args.trajectories:
        collected = file_histories(args.trajectories)
        notes.append(f"collected episodes: {len(collected)} from {' '.join(args.trajectories)}")
    elif args.collect:
        commands = max(args.depths) + 1
        with console.status(f"collecting {args.collect} textops episodes of {commands} commands"):
            collected = await collect_histories(args.collect, commands, args.seed)
        notes.append(
            f"collected episodes: {len(collected)} textops `explore` episodes of {commands} "
            "commands, run here in the real shell"
        )
    else:
        collected = []
    histories = interleave(swe, collected)
    if not histories:
        raise SystemExit(
            "sim_latency: no histories: " + "; ".join(notes) + " (give --swe-dir, "
            "--trajectories or --collect N)"
        )
    return histories, notes


def main(argv=None) -> int:
    args = parse_args(argv)
    # a log or pipe gets the table's width, not rich's 80 columns
    console = Console() if sys.stdout.isatty() else Console(width=132)
    histories, notes = asyncio.run(load_histories(args, console))
    for line in notes:
        console.print(line)
    began = time.perf_counter()
    if args.url:
        done = asyncio.run(run(args.url, histories, args, console))
    else:
        from launch.deploy.local import LocalServer
        from rl.data.rundir import CONFIG

        flags = [
            "--preset",
            "tiny",
            "--num-slots",
            str(max(args.concurrency)),
            "--max-seq-len",
            str(args.context),
        ]
        with tempfile.TemporaryDirectory(prefix="bench-sim-latency-") as tmp:
            (Path(tmp) / CONFIG).write_text("{}\n")  # --preset tiny: the defaults do
            with console.status(f"simloop serve {' '.join(flags)}"):
                server = LocalServer.start("simulator", tmp, extra_args=flags)
            with server:
                done = asyncio.run(run([server.url], histories, args, console))
    console.print(report_table(done, args))
    console.print(
        "depth: turns of history before the command; from: swe (SWE-agent) and coll "
        "(collected) histories; turns kept: those left after the oldest "
        "went to fit the context; wall to clear: mean (min-max) over trials, first request "
        "sent to last answer; tokens/s per request: its generated tokens over its own wall; "
        "aggregate: all generated tokens over the trials' walls; cap hits: no end-of-turn "
        f"within {args.max_tokens} tokens. Measured in {done['wall_s']:.0f} s "
        f"({time.perf_counter() - began:.0f} s with the server's start)."
    )
    if args.json:
        detail = {
            "urls": done["urls"],
            "model": done["model"],
            "context": done["context"],
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "trials": args.trials,
            "histories": notes,
            "wall_s": done["wall_s"],
            "warmup": done["warmup"],
            "cells": [c.summary() | {"trial_runs": c.trials} for c in done["cells"]],
        }
        write_json(args.json, "sim_latency", rows_of(done["cells"]), detail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
