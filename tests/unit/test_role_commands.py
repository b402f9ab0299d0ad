"""Every shipped TPU config starts every role. Each trainer process of the chip plan runs its
command as the GKE pods (`gke.command`) or the TPU VM workers (`tpu_vm.command`, `tpu-vm run
--planned`) would, with the environment the plan gives it (the multi-process contract
included): the command resolves to a `simloop` job whose `--dry-run` exits 0 and which gets
past every check it makes before it starts working, i.e. to writing its run directory's
config. Servers run their own commands (`vllm serve`), checked in test_gke.py."""

from __future__ import annotations

import importlib
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from launch import cli, distributed
from launch.config.loading import dump_config, load_config
from launch.config.schema import SimloopConfig
from launch.deploy import gke, tpu_worker
from launch.deploy.chips import parse_accelerator

REPO = Path(__file__).resolve().parents[2]
TARGETS = {
    "gke-v6e-8.yaml": "gke",
    "gke-v6e-32.yaml": "gke",
    "v6e-8.yaml": "tpu_vm",
    "v6e-32.yaml": "tpu_vm",
}
SHIPPED_TPU = sorted(
    p.name
    for p in (REPO / "configs").glob("*.yaml")
    if not load_config(SimloopConfig, p).chips.accelerator.startswith("cpu-")
)


class _Started(Exception):
    """The job wrote its run directory's config: every up-front check passed."""


def test_every_shipped_tpu_config_is_covered():
    assert sorted(TARGETS) == SHIPPED_TPU


def _trainer_processes(name: str, tmp_path: Path) -> list[tuple[list[str], dict[str, str]]]:
    """(command, environment) of each trainer process the pods / workers of config `name`
    start, the config they read being a copy of the resolved config under `tmp_path`."""
    cfg = load_config(SimloopConfig, REPO / "configs" / name)
    config = tmp_path / "config.yaml"
    config.write_text(dump_config(cfg))
    if TARGETS[name] == "gke":
        docs = {d["kind"]: d for d in gke.render(cfg)}
        layout = json.loads(docs["ConfigMap"]["data"]["plan.json"])
        config.write_text(docs["ConfigMap"]["data"]["config.yaml"])
        command, extra = list(cfg.gke.command), {"SIMLOOP_CONFIG": f"{gke.CONFIG_DIR}/config.yaml"}
    else:
        hosts = parse_accelerator(cfg.chips.accelerator).hosts
        addresses = ["localhost"] if hosts == 1 else [f"10.0.0.{i + 2}" for i in range(hosts)]
        layout = tpu_worker.worker_layout(cfg, addresses, str(config))
        assert cfg.tpu_vm.command, f"{name}: set tpu_vm.command (what `run --planned` runs)"
        command, extra = list(cfg.tpu_vm.command), {}
    return [
        (list(p.get("command") or command), {**p["env"], **extra})
        for host in layout["hosts"]
        for p in host["processes"]
        if p["kind"] == "train"
    ]


def _simloop_argv(command: list[str], env: dict[str, str], tmp_path: Path) -> list[str]:
    """The `simloop` argv that `command` runs in `env` (a `bash -c` case on SIMLOOP_ROLE, or
    simloop itself), caught by a `simloop` first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    caught = tmp_path / "argv.json"
    fake = bin_dir / "simloop"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\0' \"$@\" > {shlex.quote(str(caught))}\n")
    fake.chmod(0o755)
    caught.unlink(missing_ok=True)
    run_env = {**os.environ, **env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and caught.exists(), (
        f"{env['SIMLOOP_ROLE']}: {shlex.join(command)} ran no simloop job: {done.stderr}"
    )
    return caught.read_bytes().decode().split("\0")[:-1]


def _cases():
    for name in sorted(TARGETS):
        cfg = load_config(SimloopConfig, REPO / "configs" / name)
        for role in sorted(r for r in cfg.chips.roles if not r.endswith("_serve")):
            yield pytest.param(name, role, id=f"{name}-{role}")


@pytest.mark.parametrize("name, role", list(_cases()))
def test_each_trainer_role_starts(name, role, tmp_path, monkeypatch):
    procs = [(c, e) for c, e in _trainer_processes(name, tmp_path) if e["SIMLOOP_ROLE"] == role]
    assert procs, f"{name}: no process of {role}"
    joined = []
    monkeypatch.setattr(distributed, "initialize", lambda penv, **kw: joined.append(penv))
    monkeypatch.setattr("launch.compile_cache.enable_compile_cache", lambda *a, **kw: None)
    for command, env in procs:
        # The pods' config is the ConfigMap's, mounted at /config; here it is its copy.
        pod_config = f"{gke.CONFIG_DIR}/config.yaml"
        argv = [
            str(tmp_path / "config.yaml") if a == pod_config else a
            for a in _simloop_argv(command, env, tmp_path)
        ]
        job = importlib.import_module(cli.MODULES[argv[0]])

        def started(cfg, out):
            raise _Started(out)

        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            assert cli.main([*argv, "--dry-run"]) == 0, (role, argv)
            m.setattr(job, "write_config", started)
            with pytest.raises(_Started):
                code = cli.main(argv)
                pytest.fail(f"{name} {role}: `simloop {shlex.join(argv)}` exited {code} at start")
    # Each process of a multi-host group joined its job with its own id, one coordinator.
    want = [distributed.from_environ(e) for _, e in procs]
    assert joined == [w for w in want if w is not None]
