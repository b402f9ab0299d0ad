"""The demo's simulator trainer on one CPU device vs a fake 2-device mesh, same machine, same run.

XLA's CPU client can pretend to be N devices (`--xla_force_host_platform_device_count`), which
is how the demo runs its trainers on a chip plan. On a 2-core machine that mesh is only worth
it if it is faster than one device that uses both cores itself; this measures both at the
demo's simulator shape (configs/demo_cpu.yaml: `simulator.model`, `train_sim.data`), each in
its own process (the device count is fixed when JAX starts).

    .venv/bin/python bench/sim_mesh.py
    .venv/bin/python bench/sim_mesh.py --steps 5   # a smoke test
    .venv/bin/python bench/sim_mesh.py --json sim_mesh.json        # rows also as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from results import Row, add_json_flag, write_json  # bench/ is on sys.path

ROOT = Path(__file__).resolve().parents[1]


def measure(devices: int, steps: int) -> dict:
    """In this process (the parent set XLA_FLAGS): steady-state steps/s after the compile step."""
    import jax
    import numpy as np

    from launch.config.loading import load_config
    from launch.config.schema import SimloopConfig
    from rl.model.config import MeshConfig
    from rl.train.mesh import make_mesh
    from rl.train.trainer import Trainer

    cfg = load_config(SimloopConfig, ROOT / "configs" / "demo_cpu.yaml")
    data = cfg.train_sim.data
    mesh = make_mesh(MeshConfig(fsdp=devices), jax.devices()[:devices])
    trainer = Trainer(
        cfg.simulator.model,
        cfg.train_sim.optim,
        total_steps=steps + 1,
        loss="sft",
        mesh=mesh,
        valid_vocab=300,
        seed=0,
    )
    rng = np.random.default_rng(0)
    B, T = data.batch_size, data.seq_len
    batch = {
        "tokens": rng.integers(0, 256, (B, T)).astype(np.int32),
        "targets": rng.integers(0, 256, (B, T)).astype(np.int32),
        "loss_mask": np.ones((B, T), np.int32),
        "segment_ids": np.ones((B, T), np.int32),
        "positions": np.tile(np.arange(T), (B, 1)).astype(np.int32),
    }
    float(trainer.step(batch)["loss"])  # compile
    began = time.perf_counter()
    for _ in range(steps):
        metrics = trainer.step(batch)
    float(metrics["loss"])
    wall = time.perf_counter() - began
    return {"devices": devices, "step_s": wall / steps, "tokens_per_s": B * T * steps / wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    add_json_flag(parser)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.steps)))
        return 0
    rows = []
    for devices in (1, 2):
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        done = subprocess.run(
            [sys.executable, __file__, "--child", str(devices), "--steps", str(args.steps)],
            env=env,
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
        )
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    one, two = rows
    print(f"simulator train step, {os.cpu_count()} cores (demo shape):")
    for r in rows:
        print(
            f"  {r['devices']} device(s): {r['step_s'] * 1000:7.1f} ms/step, "
            f"{r['tokens_per_s']:8.0f} tokens/s"
        )
    ratio = two["tokens_per_s"] / one["tokens_per_s"]
    print(f"  2-device fake mesh / 1 device, throughput: {ratio:.2f}x")
    if args.json:
        row = Row(
            f"simulator train step, demo shape: 2-device fake mesh vs 1 device "
            f"({os.cpu_count()} cores)",
            two["tokens_per_s"],
            one["tokens_per_s"],
            "tokens/s",
        )
        write_json(args.json, "sim_mesh", [row], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
