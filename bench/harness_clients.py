"""Claude Code and Codex CLI through `simloop middleware`, measured per client: turns per
rollout, requests per turn, prompt tokens per request, the middleware's own time per request
against the agent server's call it wraps, and the share of turns not spliced onto the turn
before them.

    .venv/bin/python bench/harness_clients.py [--rollouts 1] [--clients claude-code,codex]
        [--json PATH]

What runs (as tests/integration/test_npm_harnesses.py does, here with timings): each client,
unmodified, from its pinned npm package (installed into the harness cache when missing),
inside a real local sandbox on the built-in `clamp` task, against a middleware in front of a
tiny random model served by simloop's engine in this process. The model's tokenizer is a
4,096-id byte-level BPE trained here on the repository's docs and serving code
(`dev/bpe_agent.py`, the README's agent for real harnesses), so the
clients' ~40,000-49,000-character prompts fit its 32,768-token context. The random model
(`--model random`) never ends a turn within the 24 tokens it may write, so Claude Code asks
it to go on three times and then stops, and Codex ends its turn on the truncated response;
the tool-calling one (`--model tool-calling`, the default: weights set by hand) calls the
client's shell tool once, the client runs it and sends the result, and the model answers
"Done.": a rollout of one tool round. Neither is a model that solves the task.

Measures, per client, over its rollouts:
- turns per rollout: model calls recorded in the rollout's trajectories;
- requests per turn: every request the client sent the middleware (model requests and
  Anthropic token counting), over its turns;
- prompt tokens per request: the ids each model call sent the agent server;
- middleware overhead per request: a sampled request's time in the middleware (arrival to
  its last byte, less any wait behind the rollout's other requests) minus its agent-server
  call (the middleware's `/metrics` summaries); the peer column is that call itself;
- turns not spliced: turns that opened a new segment after the rollout's first (history the
  client rewrote, a sub-agent, a side request), which training replays from their own
  context rather than as one stream. Goal 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from results import Row, add_json_flag, positive, table, write_json  # bench/ is on sys.path
from rich.console import Console

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 32768
CLIENTS = ("claude-code", "codex")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=positive, default=1, help="rollouts per client")
    p.add_argument(
        "--model",
        choices=("random", "tool-calling"),
        default="tool-calling",
        help="the agent: random weights (never ends a turn within 24 tokens) or weights that "
        "call the client's shell tool once and then answer (dev/bpe_agent.py)",
    )
    p.add_argument(
        "--clients",
        default=",".join(CLIENTS),
        help=f"comma-separated, of {', '.join(CLIENTS)}",
    )
    add_json_flag(p)
    args = p.parse_args(argv)
    args.clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    bad = [c for c in args.clients if c not in CLIENTS]
    if bad or not args.clients:
        p.error(f"--clients {bad or '(none)'} is invalid: a comma-separated list of {CLIENTS}")
    return args


async def measure(args, console: Console) -> dict:
    from envs.backends import shell_backends
    from envs.swe_suite import swe_suite
    from launch.config.loading import load_config
    from launch.config.schema import SimloopConfig
    from launch.jobs.harness import harness_shell
    from launch.jobs.middleware import running_middleware
    from rl.data.tokenizer import HFTokenizer
    from rl.data.trajectory import read_jsonl
    from rl.model import load_hf
    from rl.orchestrator.harness import HarnessConfig, HarnessRunner, pick_launcher
    from serving.client import InferenceClient
    from serving.config import ServerConfig
    from serving.engine import Engine, EngineConfig
    from serving.server import background_server

    class Recording(InferenceClient):
        """Keeps the prompt length of every model call."""

        def __init__(self, url: str):
            super().__init__(url)
            self.prompts: list[int] = []

        async def complete(self, prompt, **kw):
            self.prompts.append(len(prompt))
            return await super().complete(prompt, **kw)

    sys.path.insert(0, str(REPO / "dev"))
    from bpe_agent import bpe_agent, tool_calling_agent

    root = Path(tempfile.mkdtemp(prefix="bench-harness-clients-"))
    with console.status("training the 4,096-id BPE (dev/bpe_agent.py)"):
        bpe = bpe_agent(root / "agent")
    task = swe_suite(["clamp"])[0]
    per: dict[str, list[dict]] = {k: [] for k in args.clients}
    for kind in args.clients:
        agent = bpe
        if args.model == "tool-calling":
            agent, _ = tool_calling_agent(bpe, root / f"agent-{kind}", kind)
        tok = HFTokenizer(agent)
        cfg = harness_shell(
            load_config(
                SimloopConfig,
                REPO / "configs/demo_cpu.yaml",
                [
                    "--middleware.port", "0",
                    "--agent.tokenizer", json.dumps({"kind": "hf", "path": str(agent)}),
                    "--harness.kind", "claude-code",  # the npm cache, shown to the sandbox
                    "--middleware.max_tokens_cap", "24",  # Codex asks for no limit
                ],
            )
        )  # fmt: skip
        real = shell_backends(cfg.env.shell, run_id="bench-harness-clients").real
        hcfg = HarnessConfig(kind=kind, wall_s=300.0, step_limit=4, max_tokens=24)
        with console.status(f"installing / finding {kind}"):
            launcher = await pick_launcher(hcfg, real, task)
        _, model = load_hf(agent)
        engine = Engine(
            model,
            tok,
            EngineConfig(num_slots=2, max_seq_len=CONTEXT, prefill_chunk=2048, prefill_batch=1),
        )
        scfg = ServerConfig(host="127.0.0.1", port=0, model_name="tiny", shutdown_timeout_s=5.0)
        out = root / f"run-{kind}"
        async with background_server(engine, tok, scfg, start_timeout_s=300) as agent_url:
            client = Recording(agent_url)
            async with running_middleware(cfg, out, client) as (mw, url, admin):
                runner = HarnessRunner(hcfg, real, url, launcher, admin=admin)
                for i in range(args.rollouts):
                    requests0 = sum(mw.requests.values())
                    timing0 = dict(mw.timing)
                    prompts0 = len(client.prompts)
                    with console.status(f"{kind}: rollout {i + 1}/{args.rollouts}"):
                        result = await runner.run_one(task, f"bench-{kind}", i)
                    files = sorted((out / "trajectories").glob("middleware-*.jsonl"))
                    trajs = [
                        t for p in files for t in read_jsonl(p) if t.rollout_id == result.rollout_id
                    ]
                    plans = result.finish.get("plans") or {}
                    per[kind].append(
                        {
                            "status": result.status,
                            "reason": result.reason,
                            "wall_s": round(result.wall_s, 3),
                            "turns": sum(len(t.turns) for t in trajs),
                            "segments": len(trajs),
                            "requests": sum(mw.requests.values()) - requests0,
                            "sampled": mw.timing["sampled"] - timing0.get("sampled", 0),
                            "prompt_tokens": client.prompts[prompts0:],
                            "request_s": mw.timing["request_s"] - timing0.get("request_s", 0.0),
                            "agent_s": mw.timing["agent_s"] - timing0.get("agent_s", 0.0),
                            "not_spliced": max(plans.get("new", 0) - 1, 0),
                            "plans": plans,
                        }
                    )
                    console.print(f"{kind} rollout {i + 1}: {json.dumps(per[kind][-1])[:400]}")
            await client.close()
    return {"per_client": per, "context": CONTEXT, "vocab": 4096, "model": args.model}


def rows_of(done: dict) -> list[Row]:
    rows = []
    for kind, runs in done["per_client"].items():
        turns = sum(r["turns"] for r in runs)
        sampled = sum(r["sampled"] for r in runs)
        prompts = [n for r in runs for n in r["prompt_tokens"]]
        request_s = sum(r["request_s"] for r in runs)
        agent_s = sum(r["agent_s"] for r in runs)
        over_ms = 1000 * (request_s - agent_s) / sampled if sampled else None
        agent_ms = 1000 * agent_s / sampled if sampled else None
        rows += [
            Row(f"{kind}: turns per rollout", turns / len(runs), None, "turns"),
            Row(
                f"{kind}: requests per turn",
                sum(r["requests"] for r in runs) / turns if turns else None,
                None,
                "requests",
            ),
            Row(
                f"{kind}: prompt tokens per request (mean)",
                statistics.fmean(prompts) if prompts else None,
                None,
                "tokens",
            ),
            Row(
                f"{kind}: middleware overhead per request vs its agent-server call",
                over_ms,
                agent_ms,
                "ms",
            ),
            Row(
                f"{kind}: middleware overhead, share of the agent-server call",
                100 * over_ms / agent_ms if over_ms is not None and agent_ms else None,
                None,
                "%",
            ),
            Row(
                f"{kind}: share of turns not spliced onto the turn before",
                sum(r["not_spliced"] for r in runs) / turns if turns else None,
                None,
                "turns",
                target="0",
            ),
        ]
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=132)
    began = time.perf_counter()
    done = asyncio.run(measure(args, console))
    rows = rows_of(done)
    console.print(table("Claude Code and Codex CLI through the middleware", rows))
    console.print(
        f"{args.rollouts} rollout(s) per client on the clamp task; a tiny {done['model']} model "
        f"on a {done['vocab']}-id BPE with a {done['context']}-token context (random: never "
        "ends a turn within 24 tokens; tool-calling: one shell call, then 'Done.'). "
        "Overhead: a sampled request's time in the middleware minus its agent-server call "
        "(peer column). "
        f"Measured in {time.perf_counter() - began:.0f} s."
    )
    if args.json:
        write_json(args.json, "harness_clients", rows, done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
