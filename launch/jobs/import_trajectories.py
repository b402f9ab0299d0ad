"""`simloop import`: external trajectory files -> simloop trajectories in a run directory.

    simloop import --format swe-agent ../shared/data/swe-agent-trajectories --out runs/imported
    simloop import --format chat a.json b.json --out runs/chat --config configs/demo_cpu.yaml
    simloop import --format mini-swe-agent runs/mini/ --out runs/mini-imported

Folders are searched recursively (`*.traj` for swe-agent, `*.json` for chat, `*.traj.json` for
mini-swe-agent). SWE-agent files that hold only `history` (function calling) import from their
tool calls; a file that cannot be read (not JSON, too deep, not a regular file, ...) is named
with the reason and the rest still import and are written.
The token view is rendered with the config's agent tokenizer (`agent.tokenizer`: the byte
tokenizer by default, so this runs on any CPU). Writes `<out>/config.yaml` and
`<out>/trajectories/imported-NNNNN.jsonl`, prints a summary, and exits 1 when any file failed
(after writing the ones that imported).
Dotted config overrides go after the paths (or as `--key=value`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from launch.config import write_config
from launch.config.schema import SimloopConfig
from launch.errors import EXIT_FAILED, EXIT_USAGE
from rl.data import rundir
from rl.data.importers import FORMATS, PATTERNS, ImportConfig, import_files
from rl.data.trajectory import write_jsonl


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The import flags; `--config` and `--out` come from the CLI itself."""
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or folders to import")
    p.add_argument("--format", choices=FORMATS, default="swe-agent", help="input format")
    p.add_argument(
        "--enable-thinking",
        action="store_true",
        help="render the token view with the plain generation prompt (no empty think block)",
    )
    p.add_argument("--shard-size", type=int, default=1000, help="trajectories per JSONL shard")


def _tokenizer_name(cfg: SimloopConfig) -> str:
    tok = cfg.agent.tokenizer
    return tok.kind if tok.kind == "byte" else f"hf:{tok.path}"


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from rich.console import Console
    from rich.table import Table

    from rl.data.chat import ChatRenderer
    from rl.data.tokenizer import load_tokenizer

    console = Console(soft_wrap=True)
    err = Console(stderr=True, soft_wrap=True)
    try:
        icfg = ImportConfig(
            format=args.format, enable_thinking=args.enable_thinking, shard_size=args.shard_size
        )
    except ValueError as e:
        err.print(f"simloop import: {e}", markup=False)
        return EXIT_USAGE
    if not getattr(args, "out", None):
        err.print("simloop import: --out DIR is required (the run directory to write)")
        return EXIT_USAGE
    out = Path(args.out)
    renderer = ChatRenderer(load_tokenizer(cfg.agent.tokenizer))
    report = import_files(
        args.paths,
        icfg.format,
        renderer,
        enable_thinking=icfg.enable_thinking,
        tokenizer_name=_tokenizer_name(cfg),
    )
    write_config(cfg, out)
    trajectories = [traj for _, traj in report.imported]
    shards = []
    for start in range(0, len(trajectories), icfg.shard_size):
        shard = out / rundir.TRAJECTORIES / f"imported-{start // icfg.shard_size:05d}.jsonl"
        shards.append(write_jsonl(shard, trajectories[start : start + icfg.shard_size]))

    table = Table(title=f"simloop import ({icfg.format})")
    for column in ("file", "status", "turns", "tokens", "agent tokens"):
        table.add_column(column, justify="left" if column in ("file", "status") else "right")
    for path, traj in report.imported:
        table.add_row(
            path.name,
            traj.status,
            str(len(traj.turns)),
            str(len(traj.token_ids)),
            str(sum(traj.loss_mask)),
        )
    console.print(table)
    turns = sum(len(t.turns) for t in trajectories)
    tokens = sum(len(t.token_ids) for t in trajectories)
    console.print(
        f"files ok: {len(report.imported)}  failed: {len(report.failed)}  "
        f"turns: {turns}  tokens: {tokens}  -> {out / rundir.TRAJECTORIES} "
        f"({len(shards)} shard(s))",
        markup=False,
    )
    for _, message in report.failed:  # the message names the file and the field
        err.print(f"FAILED {message}", markup=False, highlight=False)
    if not report.imported and not report.failed:
        err.print(f"simloop import: no {PATTERNS[icfg.format]} files found in {args.paths}")
        return EXIT_FAILED
    return EXIT_FAILED if report.failed else 0
