"""`simloop rehearse`: a TPU config's whole job on this CPU machine, as the slice would run it.

    simloop rehearse --config configs/gke-v6e-32.yaml --out runs/rehearse-gke-v6e-32

Every host of the config's chip plan becomes a local "pod": `python -m launch.deploy.gke_pod`
(the GKE pod entry itself, which the TPU VM worker entry also runs its host through) with that
host's share of the plan, so every process the slice would start starts here, with the
command and environment the pod would give it. Only what a CPU cannot be changes:

- host names are 127.0.0.1 (the coordinator of a multi-host trainer, the servers' URLs);
- each process gets as many fake CPU devices as it has planned chips (`XLA_FLAGS`, after
  any the rehearsal was started with; `JAX_PLATFORMS=cpu`; the TPU_* variables stay, unread);
- models become the `tiny` preset (the same Qwen3 family) with random weights written as the
  HF checkpoint the config names, and the byte tokenizer; `vllm serve` becomes the fake vLLM
  (`serving.vllm.fake_server`, the same API and weight-loading RPC);
- the pod's file system is rebased under `--out/fs` (`/ckpt`, `/config`, `/mnt`), the relative
  paths a TPU VM worker uses under `--out/work`;
- steps, batches and contexts become a few (`OVERRIDES`), and the simulator's real
  trajectories (`train_sim.trajectories`) are collected first, by scripted agents in real bash.

It exits 0 when every training host did (the serving-only hosts are then stopped, as the
JobSet's success policy does) and checks that the run directories hold real training steps,
real episodes and published weight versions; the first failing host ends the rehearsal, with
its log named. `--dry-run [--format json]` prints every pod and its processes instead, and
writes nothing. Logs: `--out/pods/host-<i>.log`; what each run directory holds:
`--out/rehearse.json`. A TPU VM config's hosts run through the same pod entry, with the plan
`simloop tpu-vm run --planned`'s worker entry makes (`gke.host_layout`, SIMLOOP_CONFIG set).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from launch.config.schema import SimloopConfig
from launch.deploy.dry_run import add_dry_run_arguments
from launch.errors import JobError, UsageError

OVERRIDES: dict[str, Any] = {
    "orchestrator.group_size": 2,
    "orchestrator.max_tokens_per_turn": 160,
    "orchestrator.max_context_tokens": 1024,
    "orchestrator.max_concurrent_episodes": 16,
    "orchestrator.max_concurrent_real": 8,
    "train_agent.steps": 2,
    "train_agent.seq_len": 1024,
    "train_agent.log_every": 1,
    "train_agent.checkpoint.every_steps": 1,
    "train_agent.checkpoint.export_dtype": "float32",
    "train_agent.eval.tasks": 0,
    "train_sim.steps": 2,
    "train_sim.log_every": 1,
    "train_sim.eval_every": 0,
    "train_sim.checkpoint.every_steps": 1,
    "train_sim.checkpoint.export_dtype": "float32",
    "train_sim.data.seq_len": 1024,
    "vllm.max_model_len": 2048,
    "vllm.start_stagger_s": 0.0,
}
"""What the rehearsal shrinks, besides the models; batch sizes are set from the meshes."""
PORTS = 64
"""Ports a rehearsal reserves for its servers, and as many for the TPU and coordinator ports."""
DEMOS = 16
"""Scripted episodes in real bash that stand in for the simulator's real trajectories."""
WAIT_S = 1500.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeout-s",
        type=float,
        default=WAIT_S,
        help=f"stop the rehearsal after this long (default {WAIT_S:.0f})",
    )
    add_dry_run_arguments(
        p,
        what="every pod's processes (command, environment), start nothing and write nothing",
        target=False,
    )


def _target(config_path: str | None) -> str:
    """`gke` when the config file has a `gke:` section, else `tpu-vm`."""
    import yaml

    raw = yaml.safe_load(Path(config_path).read_text()) if config_path else {}
    return "gke" if isinstance(raw, dict) and "gke" in raw else "tpu-vm"


def _rebase(text: str, prefixes: list[str], root: Path) -> str:
    """`text` with every absolute path under one of `prefixes` moved under `root`."""
    for prefix in sorted(set(prefixes), key=len, reverse=True):
        p = prefix.rstrip("/")
        text = re.sub(rf"(?<![\w./-]){re.escape(p)}(?=/|\b|$)", str(root) + p, text)
    return text


def _set(cfg: SimloopConfig, dotted: str, value: Any) -> SimloopConfig:
    head, _, rest = dotted.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: _set(getattr(cfg, head), rest, value)})


def _pod_prefixes(cfg: SimloopConfig, target: str) -> list[str]:
    """The absolute paths of a pod's file system that the rehearsal moves under `out/fs`."""
    from launch.deploy.gke import CONFIG_DIR

    return [CONFIG_DIR, "/mnt", "/ckpt"] + ([cfg.gke.mount_path] if target == "gke" else [])


def _free_base(n: int) -> int:
    """The first of `n` consecutive ports free on 127.0.0.1 now."""
    import random
    import socket

    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise JobError(f"no {n} consecutive free ports on 127.0.0.1")


def rehearsal_config(
    cfg: SimloopConfig, out: Path, target: str, *, write: bool = True
) -> tuple[SimloopConfig, Path]:
    """The config as rehearsed (see the module docstring), written where the pods read it
    (`out/fs/config/config.yaml`) unless `write` is false; returns it, read back from that
    text, and its path."""
    import yaml

    from launch.config.loading import build_config, dump_config
    from launch.deploy.gke import CONFIG_DIR
    from rl.data.tokenizer import TokenizerConfig
    from rl.model.config import tiny

    models = out / "models"
    for role in ("agent", "simulator"):
        rcfg = dataclasses.replace(
            getattr(cfg, role),
            model=tiny(),
            weights=None,
            hf_path=str(models / role),
            tokenizer=TokenizerConfig(),
            server_url=None,
        )
        cfg = dataclasses.replace(cfg, **{role: rcfg})
    for key, value in OVERRIDES.items():
        cfg = _set(cfg, key, value)
    rows = cfg.agent.mesh.data_parallel
    batch = rows * max(1, -(-8 // rows))  # >= 8 episodes, a multiple of the trainer's rows
    cfg = _set(cfg, "orchestrator.batch_size", batch)
    cfg = _set(cfg, "train_sim.data.batch_size", cfg.simulator.mesh.data_parallel)
    cfg = _set(cfg, "vllm.command", [sys.executable, "-m", "serving.vllm.fake_server", "serve"])
    base = _free_base(2 * PORTS)  # one free range: the HTTP ports, then the TPU/coordinator ones
    cfg = _set(cfg, "chips.http_port_base", base)
    cfg = _set(cfg, "chips.tpu_port_base", base + PORTS)
    fs = out / "fs"
    prefixes = _pod_prefixes(cfg, target)
    text = _rebase(dump_config(cfg), prefixes, fs)
    path = Path(_rebase(f"{CONFIG_DIR}/config.yaml", prefixes, fs))
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        for p in prefixes:
            Path(_rebase(p, prefixes, fs)).mkdir(parents=True, exist_ok=True)
    return build_config(SimloopConfig, yaml.safe_load(text)), path


def _models(cfg: SimloopConfig) -> None:
    """Random tiny weights as the HF checkpoints both roles (trainers, servers) load."""
    from flax import nnx

    from rl.model import Qwen3, save_hf

    for i, role in enumerate(("agent", "simulator")):
        rcfg = getattr(cfg, role)
        if not (Path(rcfg.hf_path) / "config.json").exists():
            save_hf(rcfg.model, Qwen3(rcfg.model, rngs=nnx.Rngs(cfg.run.seed + i)), rcfg.hf_path)


def _trajectories(cfg: SimloopConfig) -> None:
    """Scripted episodes in real bash where `train_sim.trajectories` names an empty place."""
    import asyncio

    from launch.jobs.episodes import agent_tasks, job_backends
    from rl.data import ChatRenderer, load_tokenizer
    from rl.data.trajectory import write_jsonl
    from rl.session.demos import collect_demos
    from rl.train.config import WarmStartConfig

    for where in cfg.train_sim.trajectories:
        p = Path(where)
        if p.exists() and (p.is_file() or any(p.iterdir())):
            continue
        tasks, _ = agent_tasks(cfg)
        renderer = ChatRenderer(load_tokenizer(cfg.agent.tokenizer))
        demos = asyncio.run(
            collect_demos(
                WarmStartConfig(num_demos=DEMOS),
                cfg.orchestrator,
                cfg.env.terminal,
                renderer,
                job_backends(cfg),
                tasks,
                seed=cfg.run.seed,
            )
        )
        file = p if p.suffix == ".jsonl" else p / "rehearsal.jsonl"
        file.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(file, demos)
        print(
            f"simloop rehearse: {len(demos)} scripted episodes in real bash -> {file}", flush=True
        )


def layout(cfg: SimloopConfig, config_path: Path, work: Path) -> dict[str, Any]:
    """`plan.json` as the pods get it, every host at 127.0.0.1, and each process with as many
    fake CPU devices as it has chips."""
    from launch.deploy.chips import config_plan
    from launch.deploy.gke import host_layout
    from launch.distributed import DEVICE_COUNT_FLAG, merge_xla_flags

    hosts = _accelerator(cfg).hosts
    names = ["127.0.0.1"] * hosts
    plan = config_plan(cfg, hostnames=names)
    lay = host_layout(cfg, plan, hostnames=names, run_dir=str(work), config_path=str(config_path))
    for host in lay["hosts"]:
        for proc in host["processes"]:
            # The host's fake devices, after the XLA flags the user set for the whole run
            # (dumps, optimisation levels), as for any local job.
            devices = f"{DEVICE_COUNT_FLAG}={len(proc['chips'])}"
            flags = merge_xla_flags(os.environ.get("XLA_FLAGS", ""), devices)
            proc["env"].update(
                {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "SIMLOOP_CONFIG": str(config_path)}
            )
    return lay


def _accelerator(cfg: SimloopConfig):
    from launch.deploy.chips import parse_accelerator

    return parse_accelerator(cfg.chips.accelerator)


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    if not args.out:
        raise UsageError("--out DIR is required")
    if not _accelerator(cfg).is_tpu:
        raise UsageError(
            f"chips.accelerator={cfg.chips.accelerator!r}: rehearse takes a TPU "
            "config (configs/v6e-8.yaml, v6e-32.yaml, gke-v6e-8.yaml, "
            "gke-v6e-32.yaml); cpu-N plans already run here"
        )
    out = Path(args.out).absolute()
    target = _target(args.config)
    command = list((cfg.gke.command if target == "gke" else cfg.tpu_vm.command) or [])
    if not command:
        raise UsageError(
            f"{target}: the config names no trainer command "
            f"({'gke' if target == 'gke' else 'tpu_vm'}.command)"
        )
    command = [_rebase(w, _pod_prefixes(cfg, target), out / "fs") for w in command]
    work = out / "work"
    if getattr(args, "dry_run", False):
        rcfg, config_path = rehearsal_config(cfg, out, target, write=False)
        plan_path = out / "fs" / "config" / "plan.json"
        print(_dry_run(layout(rcfg, config_path, work), plan_path, command, args.format))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    rcfg, config_path = rehearsal_config(cfg, out, target)
    work.mkdir(exist_ok=True)
    _models(rcfg)
    if "sim_train" in rcfg.chips.roles:  # the simulator's trainer reads them
        _trajectories(rcfg)
    lay = layout(rcfg, config_path, work)
    plan_path = out / "fs" / "config" / "plan.json"
    plan_path.write_text(json.dumps(lay, indent=1))
    began = time.monotonic()
    code = _run_pods(lay, plan_path, command, out, work, args.timeout_s)
    if code != 0:
        return code
    summary = _check(out)
    (out / "rehearse.json").write_text(json.dumps(summary, indent=1))
    print(
        f"simloop rehearse: {args.config} ({target}, {len(lay['hosts'])} hosts) exited 0 in "
        f"{time.monotonic() - began:.0f} s: {json.dumps(summary)}",
        flush=True,
    )
    return 0


def _pod_argv(plan_path: Path, host: int, command: list[str]) -> list[str]:
    return [sys.executable, "-m", "launch.deploy.gke_pod", "--plan", str(plan_path),
            "--host-index", str(host), "--", *command]  # fmt: skip


def _dry_run(lay: dict, plan_path: Path, command: list[str], fmt: str) -> str:
    """Every pod (its entry's argv) and every process it would start (role, rank, chips,
    coordinator, command, environment)."""
    pods = []
    for h in lay["hosts"]:
        procs = [
            {
                "role": p["role"],
                "kind": p["kind"],
                "rank": p["rank"],
                "coordinator": p["coordinator"],
                "chips": p["chips"],
                "command": list(p.get("command") or command),
                "env": p["env"],
            }
            for p in h["processes"]
        ]
        pods.append(
            {
                "host": h["index"],
                "pod": _pod_argv(plan_path, h["index"], command),
                "processes": procs,
            }
        )
    if fmt == "json":
        return json.dumps({"pods": pods}, indent=1)
    lines = []
    for pod in pods:
        lines.append(f"pod {pod['host']}: {' '.join(pod['pod'])}")
        for p in pod["processes"]:
            job = f" process {p['rank']} coordinator {p['coordinator']}" if p["coordinator"] else ""
            lines.append(
                f"  {p['role']} [{p['kind']}] chips {p['chips']}{job}: "
                + " ".join(f"{k}={v}" for k, v in sorted(p["env"].items()))
                + " "
                + " ".join(p["command"])
            )
    return "\n".join(lines)


def _run_pods(
    lay: dict, plan_path: Path, command: list[str], out: Path, work: Path, timeout_s: float
) -> int:
    logs = out / "pods"
    logs.mkdir(exist_ok=True)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PATH": path}
    for k in (
        "XLA_FLAGS",
        "SIMLOOP_COORDINATOR",
        "SIMLOOP_NUM_PROCESSES",
        "SIMLOOP_PROCESS_ID",
        "SIMLOOP_SERVER_URLS",
    ):
        env.pop(k, None)
    trainers = {
        h["index"] for h in lay["hosts"] if any(p["kind"] != "serve" for p in h["processes"])
    }
    pods: dict[int, subprocess.Popen] = {}
    files = []
    print(
        f"simloop rehearse: {len(lay['hosts'])} pods (logs: {logs}/host-<i>.log), trainers "
        f"on hosts {sorted(trainers)}",
        flush=True,
    )
    try:
        for h in lay["hosts"]:
            i = h["index"]
            f = open(logs / f"host-{i}.log", "wb")  # noqa: SIM115 (closed below)
            files.append(f)
            argv = _pod_argv(plan_path, i, command)
            pods[i] = subprocess.Popen(
                argv, cwd=work, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while True:
            failed = [(i, p.returncode) for i, p in pods.items() if p.poll() not in (None, 0)]
            if failed:
                i, rc = failed[0]
                print(
                    f"simloop rehearse: host {i} failed (exit {rc}); its log: {logs}/host-{i}.log",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            if all(pods[i].poll() == 0 for i in trainers):
                return 0
            if time.monotonic() > deadline:
                print(
                    f"simloop rehearse: not done after {timeout_s:.0f} s; stopped (logs: {logs})",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            time.sleep(0.5)
    finally:
        for p in pods.values():  # the serving-only hosts, or all of them after a failure
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in pods.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in files:
            f.close()


def _check(out: Path) -> dict[str, Any]:
    """What the rehearsal's run directories hold: steps per training stage, RL episodes,
    published weight versions. JobError when no RL step or no publish happened."""
    found: dict[str, Any] = {}
    for metrics in sorted(out.rglob("metrics.jsonl")):
        run = metrics.parent
        steps: dict[str, int] = {}
        for line in metrics.read_text().splitlines():
            r = json.loads(line)
            if "step" in r and "event" not in r and r.get("stage"):
                steps[r["stage"]] = max(steps.get(r["stage"], 0), int(r["step"]))
        episodes = sum(
            len(p.read_text().splitlines()) for p in (run / "trajectories").glob("rl-*.jsonl")
        )
        versions = sorted(p.name for p in (run / "weights").glob("v[0-9]*"))
        found[str(run.relative_to(out))] = {
            "steps": steps,
            "rl_episodes": episodes,
            "published": versions,
        }
    if not any(
        v["steps"].get("rl") and v["rl_episodes"] and v["published"] for v in found.values()
    ):
        raise JobError(
            f"the pods exited 0 but no run directory under {out} holds RL steps, "
            f"episodes and published weights: {json.dumps(found)}"
        )
    return found
