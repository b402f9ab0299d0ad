"""The demo_cpu chip plan, launched for real: two `simloop serve` processes started with their
planned environment (one fake device each, planned HTTP ports) and both trainers on disjoint
fake-device sub-meshes of this process, all from `launch.deploy.chips.config_plan` — the code path a
v6e-8 takes with TPU chips."""

from __future__ import annotations

import dataclasses
import urllib.request
from pathlib import Path

import jax
import numpy as np
import pytest

from launch.config.loading import load_config, write_config
from launch.config.schema import SimloopConfig
from launch.deploy.chips import config_plan
from launch.deploy.local import LocalServer
from rl.model.config import MeshConfig
from rl.train.config import OptimConfig
from rl.train.mesh import role_meshes
from rl.train.trainer import Trainer
from tests.fakes import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SERVE_ROLES = {"agent_serve": "agent", "sim_serve": "simulator"}
TRAIN_ROLES = {"policy_train": "agent", "sim_train": "simulator"}


def test_demo_cpu_plan_runs_servers_and_trainers_on_their_own_devices(tmp_path):
    cfg = load_config(SimloopConfig, ROOT / "configs" / "demo_cpu.yaml")
    chips = dataclasses.replace(cfg.chips, http_port_base=free_port(span=2))
    cfg = dataclasses.replace(cfg, chips=chips)
    plan = config_plan(cfg)
    assert set(chips.roles) == set(SERVE_ROLES) | set(TRAIN_ROLES)
    write_config(cfg, tmp_path)

    servers = []
    try:
        for proc in plan.processes:
            if proc.kind == "serve":
                servers.append(
                    LocalServer.start(
                        SERVE_ROLES[proc.role],
                        tmp_path,
                        port=proc.http_port,
                        env=proc.env,
                        name=proc.role,
                    )
                )
        serve_procs = [p for p in plan.processes if p.kind == "serve"]
        for server, proc in zip(servers, serve_procs, strict=True):
            assert server.url.endswith(f":{proc.http_port}")
            with urllib.request.urlopen(f"{server.url}/health", timeout=30) as r:
                assert r.status == 200
            # The server process saw exactly the devices its plan entry gave it.
            first = (tmp_path / "logs" / f"{proc.role}-server.log").read_text()
            assert f"{len(proc.chips)} cpu device(s)" in first

        # Trainers: this process holds all 8 fake devices; each role takes its planned ids.
        assert jax.device_count() == 8
        ids = {role: plan.device_ids(role) for role in TRAIN_ROLES}
        meshes = role_meshes(
            {role: MeshConfig(fsdp=len(v)) for role, v in ids.items()}, device_ids=ids
        )
        rng = np.random.default_rng(0)
        seen = {}
        for role, model_role in TRAIN_ROLES.items():
            model_cfg = getattr(cfg, model_role).model
            trainer = Trainer(
                model_cfg, OptimConfig(lr=1e-3), total_steps=2, loss="sft", mesh=meshes[role]
            )
            rows = 2 * len(ids[role])
            tokens = rng.integers(0, 200, (rows, 33)).astype(np.int32)
            batch = {
                "tokens": tokens[:, :-1],
                "targets": tokens[:, 1:],
                "loss_mask": np.ones((rows, 32), np.int32),
                "segment_ids": np.ones((rows, 32), np.int32),
                "positions": np.tile(np.arange(32, dtype=np.int32), (rows, 1)),
            }
            loss = float(trainer.step(batch)["loss"])
            assert np.isfinite(loss)
            devices = {d.id for leaf in jax.tree.leaves(trainer.params) for d in leaf.devices()}
            assert devices == set(ids[role]), (role, devices)
            seen[role] = devices
        assert not seen["policy_train"] & seen["sim_train"]
    finally:
        for server in servers:
            server.stop()
