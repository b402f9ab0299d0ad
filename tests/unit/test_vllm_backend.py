"""The vllm serving backend as the path jobs take: the `serve.backend` config, replicas in the
chip planner, `--dry-run` of every job that starts processes, the GKE render running the same
server commands, and the version tag of vLLM's (version-less) completions."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from launch.cli import main
from launch.config.loading import ConfigError, load_config
from launch.config.schema import SimloopConfig
from launch.deploy import gke
from launch.deploy.chips import PlanError, config_plan, plan_chips
from rl.session import Published, VersionTagged
from serving.client import Completion

REPO = Path(__file__).resolve().parents[2]
V6E_8 = REPO / "configs" / "v6e-8.yaml"
GKE_V6E_8 = REPO / "configs" / "gke-v6e-8.yaml"
DEMO = REPO / "configs" / "demo_cpu.yaml"
CHIP_ENV = (
    "TPU_VISIBLE_CHIPS",
    "TPU_CHIPS_PER_PROCESS_BOUNDS",
    "TPU_PROCESS_BOUNDS",
    "TPU_PROCESS_PORT",
    "TPU_PROCESS_ADDRESSES",
)


def _dry_run(capsys, *argv) -> dict:
    assert main([*argv, "--dry-run", "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


# ----- replicas in the chip planner ----------------------------------------------------------


def test_v6e_8_plans_a_trainer_and_two_replicas_per_server_role_on_disjoint_chips():
    plan = plan_chips(
        "v6e-8",
        {"policy_train": 4, "agent_serve": 1, "sim_serve": 1},
        replicas={"agent_serve": 2, "sim_serve": 2},
    )
    procs = plan.processes
    assert [(p.role, p.replica) for p in procs] == [
        ("policy_train", 0),
        ("agent_serve", 0),
        ("agent_serve", 1),
        ("sim_serve", 0),
        ("sim_serve", 1),
    ]
    chips = [c for p in procs for c in p.chips]
    assert sorted(chips) == list(range(8))  # disjoint, all used
    serve = [p for p in procs if p.kind == "serve"]
    assert len({p.http_port for p in serve}) == 4
    assert len({p.env["TPU_PROCESS_PORT"] for p in procs}) == 5
    assert len({p.env["VLLM_XLA_CACHE_PATH"] for p in serve}) == 4  # a compile cache each
    for p in serve:
        assert p.env["TPU_VISIBLE_CHIPS"] == str(p.chips[0])
        assert p.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
        assert p.env["TPU_PROCESS_ADDRESSES"] == f"localhost:{p.env['TPU_PROCESS_PORT']}"


@pytest.mark.parametrize(
    ("roles", "replicas", "error"),
    [
        ({"policy_train": 4, "agent_serve": 2}, {"agent_serve": 3}, "ask for 10 chips"),
        ({"policy_train": 4}, {"policy_train": 2}, "only server roles"),
        ({"policy_train": 4}, {"agent_serve": 2}, "no such role"),
        ({"agent_serve": 1}, {"agent_serve": 0}, "positive number"),
    ],
)
def test_planner_rejects_replicas_it_cannot_place(roles, replicas, error):
    with pytest.raises(PlanError, match=error):
        plan_chips("v6e-8", roles, replicas=replicas)


def test_plan_chips_cli_shows_the_replicas(capsys):
    argv = ["plan-chips", "--accelerator", "v6e-8", "--roles",
            "policy_train=4,agent_serve=1,sim_serve=1",
            "--replicas", "agent_serve=2,sim_serve=2"]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["role"], r["replica"]) for r in rows if r["role"] == "agent_serve"] == [
        ("agent_serve", 0),
        ("agent_serve", 1),
    ]
    assert main([*argv, "--format", "env"]) == 0
    assert "# agent_serve [serve] replica 1 host 0" in capsys.readouterr().out


# ----- config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["--serve.backend", "tpu"], "'serve.backend': Cannot convert 'tpu'"),
        (["--serve.backends", "{policy: vllm}"], "ServeConfig.backends="),
        (["--serve.backends", "{agent: sglang}"], "ServeConfig.backends="),
        (["--vllm.command", "[]"], "VllmConfig.command=[] is invalid"),
        (["--chips.replicas", "{policy_train: 2}"], "ChipsConfig.replicas='policy_train'"),
        (["--chips.replicas", "{agent_serve: 0}"], "ChipsConfig.replicas.agent_serve=0"),
    ],
)
def test_bad_backend_settings_are_one_line_errors(overrides, error, capsys):
    with pytest.raises(ConfigError) as e:
        load_config(SimloopConfig, DEMO, overrides)
    assert error in str(e.value)
    assert main(["config", "--config", str(DEMO), *overrides]) == 2
    err = capsys.readouterr().err
    assert error in err and "Traceback" not in err


def test_backend_per_role_and_the_shipped_configs():
    cfg = load_config(SimloopConfig, DEMO, ["--serve.backends", "{agent: vllm}"])
    assert cfg.serve.backend_of("agent") == "vllm" and cfg.serve.backend_of("simulator") == "jax"
    assert load_config(SimloopConfig, DEMO).serve.backend == "jax"  # the demo stays on jax
    for name in ("v6e-8", "v6e-32", "gke-v6e-8", "gke-v6e-32"):
        cfg = load_config(SimloopConfig, REPO / "configs" / f"{name}.yaml")
        assert cfg.serve.backend_of("agent") == cfg.serve.backend_of("simulator") == "vllm"


# ----- --dry-run -----------------------------------------------------------------------------


def test_train_agent_dry_run_on_v6e_8_lists_the_trainer_and_vllm_servers(capsys, monkeypatch):
    monkeypatch.setenv("SIMLOOP_ADMIN_TOKEN", "secret-token-0123456789")
    before = set(sys.modules)
    out = _dry_run(capsys, "train-agent", "--config", str(V6E_8))
    assert "secret-token-0123456789" not in json.dumps(out)
    assert not {m for m in set(sys.modules) - before if m.startswith(("jax", "vllm"))}
    procs = out["processes"]
    assert set(procs[0]) == {"role", "replica", "host", "command", "env", "port"}
    servers = [p for p in procs if p["role"].endswith("_serve")]
    (trainer,) = [p for p in procs if p["role"] == "policy_train"]
    assert [(p["role"], p["replica"]) for p in servers] == [
        ("agent_serve", 0),
        ("agent_serve", 1),
        ("sim_serve", 0),
        ("sim_serve", 1),
    ]
    chips = [trainer["env"]["TPU_VISIBLE_CHIPS"]] + [p["env"]["TPU_VISIBLE_CHIPS"] for p in servers]
    flat = [int(c) for cs in chips for c in cs.split(",")]
    assert sorted(flat) == list(range(8))  # disjoint
    assert trainer["command"][-4:] == ["--config", "RUN_DIR/config.yaml", "--out", "RUN_DIR"]
    assert "train-agent" in trainer["command"]
    for p in servers:
        cmd, env = p["command"], p["env"]
        assert cmd[:3] == ["vllm", "serve", "/mnt/models/Qwen3-1.7B"]
        assert all(k in env for k in CHIP_ENV)
        assert env["TPU_PROCESS_ADDRESSES"] == f"localhost:{env['TPU_PROCESS_PORT']}"
        assert _flag(cmd, "--tensor-parallel-size") == str(len(env["TPU_VISIBLE_CHIPS"].split(",")))
        assert _flag(cmd, "--worker-extension-cls").endswith("OrbaxWeightLoader")
        assert _flag(cmd, "--port") == str(p["port"]) == env["SIMLOOP_HTTP_PORT"]
        assert _flag(cmd, "--served-model-name") == (
            "agent" if "agent" in p["role"] else "simulator"
        )
        assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert len({p["port"] for p in servers}) == 4


def test_vllm_command_prefix_is_the_configured_one(capsys):
    fake = '["python", "-m", "serving.vllm.fake_server", "serve"]'
    out = _dry_run(capsys, "eval-sim", "--config", str(V6E_8), "--vllm.command", fake)
    (first, *_) = out["processes"]
    assert first["command"][:5] == [
        "python",
        "-m",
        "serving.vllm.fake_server",
        "serve",
        "/mnt/models/Qwen3-1.7B",
    ]


def test_every_job_that_starts_processes_has_a_dry_run(capsys, tmp_path):
    for job in ("rollout", "train-agent", "eval-sim", "eval-agent"):
        out = _dry_run(capsys, job, "--config", str(DEMO), "--out", str(tmp_path / job))
        roles = [p["role"] for p in out["processes"]]
        assert "agent_serve" in roles or "sim_serve" in roles, (job, roles)
        assert not (tmp_path / job).exists()  # nothing written, nothing started
    # jax backend: simloop's own server, on its planned fake devices, a free port at start.
    out = _dry_run(capsys, "train-agent", "--config", str(DEMO))
    agent = next(p for p in out["processes"] if p["role"] == "agent_serve")
    assert agent["command"][1:4] == ["-m", "launch", "serve"]
    assert _flag(agent["command"], "--role") == "agent"
    assert "--checkpoint-root" in agent["command"]  # the trainer publishes to it
    assert agent["env"]["SIMLOOP_DEVICE_IDS"] and agent["port"] is None
    trainer = next(p for p in out["processes"] if p["role"] == "policy_train")
    assert trainer["env"]["SIMLOOP_DEVICE_IDS"] == "0,1,2,3"
    # text: one process per line
    argv = ["rollout", "--config", str(DEMO), "--orchestrator.arm", "closed_loop", "--dry-run"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["agent_serve[0]", "sim_serve[0]", "rollout[0]"]


def test_demo_dry_run_lists_each_stages_servers_then_itself(capsys, tmp_path):
    out = _dry_run(capsys, "demo", "--config", str(DEMO), "--out", str(tmp_path / "demo"))
    listed = [(p["stage"], p["role"]) for p in out["processes"]]
    assert listed == [
        ("eval_sim", "sim_serve"),
        ("agent", "agent_serve"),
        ("agent", "sim_serve"),
        ("agent_real", "agent_serve"),
        ("demo", "demo"),
    ]
    assert not (tmp_path / "demo").exists()  # nothing written, nothing started
    servers = [p for p in out["processes"] if p["role"] != "demo"]
    assert all(p["command"][1:4] == ["-m", "launch", "serve"] for p in servers)
    # each stage's server reads that stage's own config
    stages = {_flag(p["command"], "--config").split("/")[-2] for p in servers}
    assert stages == {"eval_sim", "agent", "agent_real"}
    demo = out["processes"][-1]
    assert "--out" in demo["command"] and "8" in demo["env"]["XLA_FLAGS"]


def test_a_configured_server_url_is_not_started(capsys):
    out = _dry_run(
        capsys,
        "eval-agent",
        "--config",
        str(V6E_8),
        "--agent.server_url",
        "http://127.0.0.1:9",
        "--train_agent.eval.arms",
        "[real]",
    )
    assert [p["role"] for p in out["processes"]] == ["eval-agent"]


def test_vllm_without_planned_servers_is_a_one_line_error(capsys):
    argv = ["eval-sim", "--config", str(V6E_8), "--chips.roles", "{policy_train: 4}",
            "--chips.replicas", "{}", "--dry-run"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "add sim_serve to chips.roles" in err and "Traceback" not in err


def test_a_job_that_would_start_vllm_where_it_cannot_run_says_so_before_starting(
    capsys, monkeypatch, tmp_path
):
    from launch.errors import UsageError
    from launch.jobs.episodes import check_servers
    from serving.vllm import launcher

    # Whatever this machine has, as on a Python 3.11 install: no vLLM can start here.
    monkeypatch.setattr(launcher, "vllm_missing", lambda: "vllm is not installed (test)")
    out = tmp_path / "run"
    argv = ["train-agent", "--config", str(DEMO), "--out", str(out), "--serve.backend", "vllm"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "serve.backend=vllm" in err and "vllm is not installed (test)" in err
    assert "serve.backends: {agent: jax}" in err and "Traceback" not in err
    assert not out.exists()  # refused before the run directory was made
    cfg = load_config(SimloopConfig, DEMO, ["--serve.backend", "vllm"])
    with pytest.raises(UsageError):
        check_servers(cfg, ["agent"])
    # Not where nothing is started here: a given server, or another launcher (the fake vLLM).
    given = load_config(
        SimloopConfig, DEMO, ["--serve.backend", "vllm", "--agent.server_url", "http://h:1"]
    )
    check_servers(given, ["agent"])
    fake = load_config(
        SimloopConfig,
        DEMO,
        ["--serve.backend", "vllm", "--vllm.command", f"[{sys.executable}, -m, fake, serve]"],
    )
    check_servers(fake, ["agent"])
    monkeypatch.setenv("SIMLOOP_SERVER_URLS", json.dumps({"agent": ["http://h:1"]}))
    check_servers(cfg, ["agent"])  # a GKE pod's servers, started beside it


# ----- the GKE render runs the same commands --------------------------------------------------


def test_gke_render_runs_the_commands_the_dry_run_lists(capsys):
    out = _dry_run(capsys, "train-agent", "--config", str(GKE_V6E_8))
    listed = {(p["role"], p["replica"]): p for p in out["processes"]}
    cfg = load_config(SimloopConfig, GKE_V6E_8)
    docs = {d["kind"]: d for d in gke.render(cfg)}
    (host,) = json.loads(docs["ConfigMap"]["data"]["plan.json"])["hosts"]
    rendered = {(p["role"], p["replica"]): p for p in host["processes"]}
    assert set(rendered) == set(listed)
    for key, proc in rendered.items():
        want = listed[key]
        if proc["kind"] == "serve":
            assert proc["command"] == want["command"]
            for k, v in want["env"].items():
                if k != "PYTHONPATH":  # the image has simloop installed
                    assert proc["env"][k] == v, (key, k)
        else:  # the trainer runs gke.command: the same job, on the same chips
            assert "command" not in proc
            assert cfg.gke.command[:2] == ["simloop", "train-agent"]
            for k in CHIP_ENV:
                assert proc["env"][k] == want["env"][k]
            urls = json.loads(proc["env"]["SIMLOOP_SERVER_URLS"])
            ports = [p["port"] for p in out["processes"] if p["role"] == "agent_serve"]
            assert urls["agent"] == [f"http://127.0.0.1:{port}" for port in ports]
    container = docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert container["spec"]["containers"][0]["command"][6:] == cfg.gke.command


def test_dry_run_target_gke_is_exactly_what_the_pods_start(capsys):
    """`--dry-run --target gke` prints the render's plan.json: every process of every pod with
    the command it runs there (the trainer: `gke.command`) and its whole environment."""
    out = _dry_run(capsys, "train-agent", "--config", str(GKE_V6E_8), "--target", "gke")
    cfg = load_config(SimloopConfig, GKE_V6E_8)
    docs = {d["kind"]: d for d in gke.render(cfg)}
    hosts = json.loads(docs["ConfigMap"]["data"]["plan.json"])["hosts"]
    want = [
        {
            "role": p["role"],
            "replica": p["replica"],
            "host": h["hostname"],
            "command": p.get("command", cfg.gke.command),
            "env": p["env"],
            "port": p["http_port"],
        }
        for h in hosts
        for p in h["processes"]
    ]
    assert out["processes"] == want
    trainer = [p for p in out["processes"] if p["role"] == "policy_train"]
    assert [p["command"] for p in trainer] == [cfg.gke.command]
    # The pods run gke.command: a dry run of another job for them is a one-line error.
    assert main(["rollout", "--config", str(GKE_V6E_8), "--dry-run", "--target", "gke"]) == 2
    assert "the pods run gke.command" in capsys.readouterr().err


def test_gke_render_needs_an_hf_path_for_vllm_servers():
    cfg = load_config(SimloopConfig, GKE_V6E_8, ["--simulator.hf_path", "null"])
    want = r"simulator: vLLM servers started from the chip plan \(GKE pods, TPU VM workers\) start"
    with pytest.raises(gke.GkeError, match=want):
        gke.render(cfg)


def test_config_plan_keeps_replicas_unless_roles_are_overridden():
    cfg = load_config(SimloopConfig, V6E_8)
    assert len(config_plan(cfg).role("agent_serve")) == 2
    assert len(config_plan(cfg, roles={"agent_serve": 2}).role("agent_serve")) == 1


# ----- version tags of vLLM completions -------------------------------------------------------


class _SlowClient:
    """Answers like vLLM (no weight version) once `release` is set."""

    def __init__(self):
        self.release, self.started = asyncio.Event(), asyncio.Event()

    async def complete(self, prompt, **kw) -> Completion:
        self.started.set()
        await self.release.wait()
        return Completion(text="x", token_ids=[1], finish_reason="stop", logprobs=[-0.1])


class _Publisher:
    async def publish(self, path, version):
        return version


def test_vllm_tokens_carry_the_version_published_before_the_request():
    async def go():
        published = Published(_Publisher())
        await published.publish("/w/v1", 1)
        inner = _SlowClient()
        client = VersionTagged(inner, published)
        request = asyncio.create_task(client.complete([5], max_tokens=1), name="request")
        await inner.started.wait()
        await published.publish("/w/v2", 2)  # lands while the request decodes
        inner.release.set()
        first = await request
        second = await client.complete([5], max_tokens=1)
        return first.weight_version, second.weight_version

    assert asyncio.run(go()) == (1, 2)


def test_a_local_tpu_trainer_takes_only_its_planned_chips():
    from launch.deploy.chips import trainer_tpu_env

    cfg = load_config(SimloopConfig, V6E_8)
    env = trainer_tpu_env(cfg, "agent", {})
    assert env["TPU_VISIBLE_CHIPS"] == "0,1,2,3" and env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,4,1"
    assert trainer_tpu_env(cfg, "agent", {"TPU_VISIBLE_CHIPS": "0"}) == {}  # pinned already
    assert trainer_tpu_env(load_config(SimloopConfig, DEMO), "agent", {}) == {}  # CPU plan


def test_vllm_servers_must_hold_the_episode_context():
    from launch.config.schema import check_local_servers

    cfg = load_config(SimloopConfig, V6E_8, ["--vllm.max_model_len", "4096"])
    with pytest.raises(ValueError, match=r"at most vllm.max_model_len \(4096\)"):
        check_local_servers(cfg, ["agent"])
    check_local_servers(load_config(SimloopConfig, V6E_8), ["agent", "simulator"])
