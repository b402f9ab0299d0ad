"""`simloop e2b sweep`: kill E2B sandboxes that simloop started and nobody closed (a killed run
leaves its sandboxes running until their timeout).

    E2B_API_KEY=... simloop e2b sweep --run-id demo --older-than-s 3600
"""

from __future__ import annotations

import argparse
import asyncio
import os

from launch.config.schema import SimloopConfig
from launch.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-id", help="only sandboxes tagged with this run (default: all)")
    p.add_argument(
        "--older-than-s",
        type=float,
        default=0.0,
        help="only sandboxes started at least this long ago",
    )


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from envs.e2b import sweep

    if args.action != "sweep":
        raise UsageError("say which action: sweep")
    if not os.environ.get("E2B_API_KEY"):
        raise UsageError("E2B_API_KEY is not set")
    killed = asyncio.run(
        sweep(args.run_id, config=cfg.env.shell.e2b, older_than_s=args.older_than_s)
    )
    scope = f"run {args.run_id!r}" if args.run_id else "all simloop runs"
    print(f"simloop e2b sweep: killed {len(killed)} sandbox(es) of {scope}")
    for sandbox_id in killed:
        print(f"  {sandbox_id}")
    return 0
