"""What running one trainer as several JAX processes costs: the same SFT steps (`Trainer.step`,
one model over one 8-device FSDP mesh, the same global batches) as 2 processes x 4 fake CPU
devices (multi-controller, collectives over gloo between the processes, what the hosts of a pod
slice are) against 1 process x 8 devices (every collective inside one process), in the same run.

Each job is started as simloop starts it (`launch/distributed.py`: the environment contract,
`jax.distributed.initialize`, batches placed per process by `Trainer.device_batch`); the step
time is the median over timed steps after two compile/warm-up steps, read on process 0.

    .venv/bin/python bench/multihost_sft.py                 # ~1-2 minutes on 2 cores
    .venv/bin/python bench/multihost_sft.py --steps 5 --json multihost.json

Reported, no target (issue 56): the 2-process step time over the 1-process one. On one CPU
machine both jobs share the same cores, so the ratio is what the cross-process collectives
(gloo over loopback TCP, plus each process's own runtime) cost over in-process ones, not a
prediction for TPU hosts, whose collectives go over ICI/DCN.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICES = 8


def worker(args: argparse.Namespace) -> None:
    """One process of a job: join the runtime (if several), train, report from process 0."""
    from launch import distributed

    penv = distributed.from_environ(os.environ)
    if penv is not None:
        distributed.initialize(penv, heartbeat_timeout_s=30)
    import jax
    import numpy as np

    from rl.model.config import MeshConfig, tiny
    from rl.model.sharding import make_mesh
    from rl.train.config import OptimConfig
    from rl.train.multihost import fetch
    from rl.train.trainer import Trainer

    cfg = tiny()
    mesh = make_mesh(MeshConfig(fsdp=DEVICES), jax.devices())
    trainer = Trainer(
        cfg, OptimConfig(lr=1e-3, warmup_steps=0), total_steps=100, loss="sft", mesh=mesh, seed=0
    )
    B, T = DEVICES * args.rows_per_device, args.seq_len
    rng = np.random.default_rng(0)

    def batch() -> dict:
        seq = rng.integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
        return {
            "tokens": seq[:, :-1],
            "targets": seq[:, 1:],
            "loss_mask": np.ones((B, T), np.int32),
            "segment_ids": np.ones((B, T), np.int32),
            "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)),
        }

    times = []
    for i in range(2 + args.steps):
        b = batch()
        t = time.perf_counter()
        fetch(trainer.step(b)["loss"])  # synchronous: the step's whole time
        if i >= 2:
            times.append(time.perf_counter() - t)
    # After the timed steps: compiling the step again to read its program slowed later steps.
    hlo = trainer._step_fn.lower(trainer.state, trainer.device_batch(batch()), None)
    text = hlo.compile().as_text()
    collectives = {
        op: len(re.findall(rf"= [^=]*? {op}(-start)?\(", text))
        for op in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
    }
    # One small all-reduce, alone: what a collective costs here before any bytes move.
    from jax.sharding import NamedSharding, PartitionSpec

    rows = NamedSharding(mesh, PartitionSpec("fsdp"))
    ones = np.ones((DEVICES, 256), np.float32)
    small = jax.make_array_from_callback(ones.shape, rows, lambda i: ones[i])
    reduce = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, PartitionSpec()))
    fetch(reduce(small))
    t = time.perf_counter()
    for _ in range(50):
        fetch(reduce(small))
    allreduce_s = (time.perf_counter() - t) / 50
    if jax.process_index() == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "step_s": statistics.median(times),
                    "steps": times,
                    "processes": jax.process_count(),
                    "tokens": B * T,
                    "collectives": collectives,
                    "small_allreduce_s": allreduce_s,
                }
            ),
            flush=True,
        )


def job(processes: int, args: argparse.Namespace) -> dict:
    from launch.distributed import local_environments

    base = {k: v for k, v in os.environ.items() if not k.startswith("SIMLOOP_")}
    envs = local_environments(processes, DEVICES // processes, base)
    if processes == 1:
        envs = [{k: v for k, v in envs[0].items() if not k.startswith("SIMLOOP_")}]
    cmd = [sys.executable, __file__, "--worker", "--steps", str(args.steps), "--rows-per-device",
           str(args.rows_per_device), "--seq-len", str(args.seq_len)]  # fmt: skip
    procs = [
        subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for env in envs
    ]
    outs = [p.communicate(timeout=args.timeout) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"a {processes}-process job failed ({p.returncode}):\n{err[-3000:]}")
    line = next(x for x in outs[0][0].splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    sys.path.insert(0, str(ROOT))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per job")
    parser.add_argument("--rows-per-device", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    sys.path.insert(0, str(Path(__file__).parent))
    from results import Row, add_json_flag, table, write_json

    add_json_flag(parser)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from rich.console import Console

    console = Console()
    one = job(1, args)
    console.print(f"1 process x 8 devices: {one['step_s'] * 1e3:.0f} ms/step")
    two = job(2, args)
    console.print(f"2 processes x 4 devices: {two['step_s'] * 1e3:.0f} ms/step")
    rows = [
        Row(
            f"SFT step time, tiny model, B={one['tokens'] // args.seq_len} T={args.seq_len}, "
            "2 processes x 4 devices vs 1 process x 8 (same mesh and batches)",
            two["step_s"] * 1e3,
            one["step_s"] * 1e3,
            "ms",
            target=None,
        ),
    ]
    console.print(table("multi-process SFT (gloo) vs one process", rows))
    ratio = two["step_s"] / one["step_s"]
    console.print(f"2-process / 1-process step time: {ratio:.2f}x")
    n = sum(two["collectives"].values())
    per = {k: v for k, v in two["collectives"].items() if v}
    console.print(
        f"where: the step's program text holds {n} collectives ({per}; those in the layer "
        f"scan run once per layer); one small "
        f"all-reduce alone takes {two['small_allreduce_s'] * 1e3:.2f} ms across processes "
        f"against {one['small_allreduce_s'] * 1e3:.2f} ms inside one, so the collectives "
        f"account for about {n * (two['small_allreduce_s'] - one['small_allreduce_s']) * 1e3:.0f}"
        f" ms of the {(two['step_s'] - one['step_s']) * 1e3:.0f} ms the step gained"
    )
    if args.json:
        write_json(args.json, "multihost_sft", rows, {"one": one, "two": two})


if __name__ == "__main__":
    main()
