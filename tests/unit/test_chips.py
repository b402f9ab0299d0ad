"""The chip partition planner (`launch/chips.py`, `simloop plan-chips`)."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest

from launch.cli import main
from launch.config.loading import load_config
from launch.config.schema import SimloopConfig
from launch.deploy.chips import PlanError, config_plan, parse_accelerator, parse_roles, plan_chips


def _env(plan, role):
    (p,) = plan.role(role)
    return p.env


@pytest.mark.parametrize(
    "roles, want",
    [
        (
            {"policy_train": 4, "agent_serve": 2, "sim_serve": 2},
            {
                "policy_train": ("0,1,2,3", "1,4,1"),
                "agent_serve": ("4,5", "1,2,1"),
                "sim_serve": ("6,7", "1,2,1"),
            },
        ),
        (
            {"policy_train": 2, "sim_train": 2, "agent_serve": 2, "sim_serve": 2},
            {
                "policy_train": ("0,1", "1,2,1"),
                "sim_train": ("2,3", "1,2,1"),
                "agent_serve": ("4,5", "1,2,1"),
                "sim_serve": ("6,7", "1,2,1"),
            },
        ),
        (
            {f"r{i}_serve": 1 for i in range(8)},
            {f"r{i}_serve": (str(i), "1,1,1") for i in range(8)},
        ),
        (
            {"policy_train": 4, "sim_train": 4},
            {"policy_train": ("0,1,2,3", "1,4,1"), "sim_train": ("4,5,6,7", "1,4,1")},
        ),
        ({"policy_train": 8}, {"policy_train": ("0,1,2,3,4,5,6,7", "2,4,1")}),
    ],
)
def test_v6e_8_splits(roles, want):
    plan = plan_chips("v6e-8", roles)
    ports = set()
    for role, (chips, bounds) in want.items():
        env = _env(plan, role)
        assert env["TPU_VISIBLE_CHIPS"] == chips
        assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == bounds
        assert env["TPU_PROCESS_BOUNDS"] == "1,1,1"
        assert env["CLOUD_TPU_TASK_ID"] == "0"
        assert env["TPU_PROCESS_ADDRESSES"] == f"localhost:{env['TPU_PROCESS_PORT']}"
        ports.add(env["TPU_PROCESS_PORT"])
        if role.endswith("_serve"):
            assert env["VLLM_XLA_CACHE_PATH"].endswith(f"/{role}")
    assert len(ports) == len(roles), "every process needs its own TPU_PROCESS_PORT"
    servers = [p for p in plan.processes if p.kind == "serve"]
    assert len({p.http_port for p in servers}) == len(servers)
    assert len({p.env.get("VLLM_XLA_CACHE_PATH") for p in servers}) == len(servers)


def test_the_plan_keeps_the_role_order_but_places_big_blocks_first():
    plan = plan_chips("v6e-8", {"agent_serve": 2, "policy_train": 4, "sim_serve": 1})
    assert [p.role for p in plan.processes] == ["agent_serve", "policy_train", "sim_serve"]
    assert plan.role("policy_train")[0].chips == (0, 1, 2, 3)
    assert plan.role("agent_serve")[0].chips == (4, 5)
    assert plan.role("sim_serve")[0].chips == (6,)


@pytest.mark.parametrize(
    "acc, roles, needle",
    [
        ("v6e-8", {"policy_train": 3}, "3 chips is not a legal sub-slice of a v6e-8"),
        ("v6e-8", {"policy_train": 4, "agent_serve": 6}, "ask for 10 chips"),
        ("v6e-8", {"a_serve": 4, "b_serve": 4, "c_serve": 1}, "a v6e-8 has 8"),
        ("v6e-4", {"policy_train": 8}, "a v6e-4 has 4"),
        ("v6e-32", {"agent_serve": 8}, "a server must fit on one host"),
        ("v6e-32", {"policy_train": 12}, "or whole hosts"),
        ("v6e-7", {"policy_train": 1}, "v6e slices have"),
        ("tpu9-8", {"policy_train": 1}, "unknown family"),
        ("v5p-12", {"policy_train": 1}, "counts TensorCores"),
        ("v6e-8", {}, "no roles"),
    ],
)
def test_illegal_plans_say_what_would_work(acc, roles, needle):
    with pytest.raises(PlanError, match=needle):
        plan_chips(acc, roles)


def test_three_chips_message_lists_the_legal_shapes():
    with pytest.raises(PlanError) as e:
        plan_chips("v6e-8", {"policy_train": 3})
    msg = str(e.value)
    for shape in ("1 (1,1,1)", "2 (1,2,1)", "4 (1,4,1)", "8 (2,4,1)"):
        assert shape in msg
    assert "2,2,1" not in msg.split("A process takes")[1]


def test_accelerators():
    v6e8 = parse_accelerator("v6e-8")
    assert (v6e8.chips, v6e8.hosts, v6e8.host_grid, v6e8.topology) == (8, 1, (2, 4, 1), "2x4")
    assert v6e8.gke_accelerator == "tpu-v6e-slice"
    v6e32 = parse_accelerator("v6e-32")
    assert (v6e32.chips_per_host, v6e32.hosts, v6e32.topology) == (4, 8, "4x8")
    assert parse_accelerator("v6e-256").hosts == 64
    v5p = parse_accelerator("v5p-8")  # 8 TensorCores = 4 chips
    assert (v5p.chips, v5p.hosts, v5p.topology) == (4, 1, "2x2x1")
    assert parse_accelerator("v5p-32").hosts == 4
    assert parse_accelerator("v5litepod-4").gke_accelerator == "tpu-v5-lite-podslice"
    cpu = parse_accelerator("cpu-8")
    assert not cpu.is_tpu and cpu.host_grid == (2, 4, 1)


def test_multi_host_roles_span_whole_hosts_with_one_process_each():
    names = [f"w{i}.svc" for i in range(8)]
    plan = plan_chips(
        "v6e-32",
        {"policy_train": 16, "sim_train": 8, "agent_serve": 4, "sim_serve": 2},
        hostnames=names,
    )
    policy = plan.role("policy_train")
    assert [p.host for p in policy] == [0, 1, 2, 3] and [p.rank for p in policy] == [0, 1, 2, 3]
    port = policy[0].env["TPU_PROCESS_PORT"]
    for p in policy:
        assert p.env["TPU_PROCESS_BOUNDS"] == "1,4,1"  # 4 hosts along y of the 2x4 host grid
        assert p.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"
        assert p.env["TPU_PROCESS_ADDRESSES"] == ",".join(f"{n}:{port}" for n in names[:4])
        assert p.env["CLOUD_TPU_TASK_ID"] == str(p.rank)
    sim = plan.role("sim_train")
    assert [p.host for p in sim] == [4, 5] and sim[0].env["TPU_PROCESS_BOUNDS"] == "1,2,1"
    (serve,) = plan.role("agent_serve")
    assert serve.host == 6 and serve.bounds == (2, 2, 1)
    (small,) = plan.role("sim_serve")
    assert small.host == 7 and small.chips == (0, 1) and small.bounds == (1, 2, 1)
    with pytest.raises(PlanError, match="2 hostnames for a v6e-32 with 8 hosts"):
        plan_chips("v6e-32", {"policy_train": 4}, hostnames=["a", "b"])


def test_a_trainer_on_several_hosts_is_one_job_with_the_process_contract():
    """Each process of a multi-host trainer group gets SIMLOOP_COORDINATOR (the group's first
    host at a port of its own), SIMLOOP_NUM_PROCESSES (its hosts) and SIMLOOP_PROCESS_ID (its
    rank); one-host roles, trainers included, and servers get none."""
    names = [f"w{i}.svc" for i in range(8)]
    roles = {"policy_train": 16, "sim_train": 8, "agent_serve": 4, "sim_serve": 2}
    plan = plan_chips("v6e-32", roles, hostnames=names)
    coordinators = {}
    for role, hosts in (("policy_train", [0, 1, 2, 3]), ("sim_train", [4, 5])):
        procs = plan.role(role)
        assert [p.host for p in procs] == hosts
        assert [p.env["SIMLOOP_PROCESS_ID"] for p in procs] == [str(i) for i in range(len(hosts))]
        assert {p.env["SIMLOOP_NUM_PROCESSES"] for p in procs} == {str(len(hosts))}
        (coordinator,) = {p.env["SIMLOOP_COORDINATOR"] for p in procs}
        assert {p.coordinator for p in procs} == {coordinator}
        host, port = coordinator.rsplit(":", 1)
        assert host == names[hosts[0]] == procs[0].hostname
        assert [p.hostname for p in procs] == [names[h] for h in hosts]
        # The TPU runtime's view of the group is the same job.
        assert all(p.env["CLOUD_TPU_TASK_ID"] == p.env["SIMLOOP_PROCESS_ID"] for p in procs)
        coordinators[role] = int(port)
    # Its own port: after every group's TPU process port, apart from the HTTP ports.
    tpu_ports = {int(p.env["TPU_PROCESS_PORT"]) for p in plan.processes}
    http_ports = {p.http_port for p in plan.processes if p.http_port}
    assert coordinators == {"policy_train": 8480, "sim_train": 8481}
    assert not set(coordinators.values()) & (tpu_ports | http_ports)
    for p in plan.role("agent_serve") + plan.role("sim_serve"):
        assert p.coordinator is None and not any(k.startswith("SIMLOOP_COORD") for k in p.env)
        assert "SIMLOOP_PROCESS_ID" not in p.env and "SIMLOOP_NUM_PROCESSES" not in p.env
    # A trainer that fits one host is a one-process job, on a multi-host slice too.
    one = plan_chips("v6e-32", {"policy_train": 16, "sim_train": 4})
    (sim,) = one.role("sim_train")
    assert sim.coordinator is None and "SIMLOOP_NUM_PROCESSES" not in sim.env
    # Without host names the first host stands for itself, as in TPU_PROCESS_ADDRESSES.
    assert {p.coordinator for p in one.role("policy_train")} == {"host-0:8478"}
    for single in (plan_chips("v6e-8", {"policy_train": 8}), plan_chips("cpu-8", {"x": 8})):
        assert all(p.coordinator is None for p in single.processes)
        assert not any("SIMLOOP_COORDINATOR" in p.env for p in single.processes)


def test_coordinator_and_tpu_ports_never_meet_the_http_ports():
    roles = {"policy_train": 16, "sim_train": 8, "agent_serve": 4, "sim_serve": 2}
    # TPU process ports 9000-9003, coordinators 9004-9005; the servers' from 9005: refused.
    with pytest.raises(PlanError, match=r"9000-9005 .*overlap the servers' HTTP ports 9005-9006"):
        plan_chips("v6e-32", roles, tpu_port_base=9000, http_port_base=9005)
    plan = plan_chips("v6e-32", roles, tpu_port_base=9000, http_port_base=9006)
    assert [p.http_port for p in plan.processes if p.http_port] == [9006, 9007]
    plan_chips("v6e-32", {"policy_train": 16}, tpu_port_base=9000, http_port_base=9000)


def _legal_sizes(acc):
    sizes = [1]
    while sizes[-1] * 2 <= acc.chips:
        sizes.append(sizes[-1] * 2)
    return sizes


@pytest.mark.parametrize(
    "acc_name", ["v6e-1", "v6e-4", "v6e-8", "v6e-16", "v6e-32", "v5p-16", "cpu-8"]
)
def test_property_every_accepted_plan_is_disjoint_and_fits(acc_name):
    """Random requests (seeded): an accepted plan gives disjoint chips inside the slice,
    bounds whose product is the chips per process, and process bounds whose product is the
    role's process count; a refused one is refused with PlanError, never anything else."""
    acc = parse_accelerator(acc_name)
    rng = random.Random(acc_name)
    accepted = 0
    for _trial in range(300):
        roles = {}
        for i in range(rng.randint(1, 5)):
            kind = rng.choice(["train", "serve"])
            roles[f"r{i}_{kind}"] = rng.choice(_legal_sizes(acc) + [3, 5, 6])
        try:
            plan = plan_chips(acc, roles)
        except PlanError:
            continue
        accepted += 1
        used = set()
        for role, n in roles.items():
            procs = plan.role(role)
            assert sum(len(p.chips) for p in procs) == n
            for p in procs:
                assert math.prod(p.bounds) == len(p.chips)
                assert all(0 <= c < acc.chips_per_host for c in p.chips)
                assert 0 <= p.host < acc.hosts
                if acc.is_tpu:
                    pb = [int(x) for x in p.env["TPU_PROCESS_BOUNDS"].split(",")]
                    assert math.prod(pb) == len(procs) == p.group_size
                    assert p.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == ",".join(map(str, p.bounds))
                for c in p.chips:
                    assert (p.host, c) not in used, f"chip {c} of host {p.host} given twice"
                    used.add((p.host, c))
        assert len(used) <= acc.chips
        ports = [p.env.get("TPU_PROCESS_PORT", p.role) for p in plan.processes if p.rank == 0]
        assert len(set(ports)) == len(ports)
        # Multi-host trainer groups (and only those) are jobs with a coordinator of their own.
        groups = {(p.role, p.replica): p for p in plan.processes if p.rank == 0}
        coordinators = [p.coordinator for p in groups.values() if p.coordinator]
        assert len(set(coordinators)) == len(coordinators)
        assert all(
            (p.coordinator is not None) == (p.kind == "train" and p.group_size > 1)
            for p in plan.processes
        )
        taken = {p.http_port for p in plan.processes} | set(ports)
        assert not {int(c.rsplit(":", 1)[1]) for c in coordinators} & taken
    assert accepted >= 10, "the property was checked on too few accepted plans"


def test_every_split_of_v6e_8_into_legal_sizes_is_accepted():
    for k in range(1, 5):
        for sizes in itertools.product([1, 2, 4, 8], repeat=k):
            if sum(sizes) <= 8:
                plan_chips("v6e-8", {f"r{i}": s for i, s in enumerate(sizes)})


def test_cpu_plans_give_device_ids_and_server_device_counts():
    plan = plan_chips(
        "cpu-8", {"policy_train": 4, "sim_train": 2, "agent_serve": 1, "sim_serve": 1}
    )
    assert plan.device_ids("policy_train") == [0, 1, 2, 3]
    assert plan.device_ids("sim_train") == [4, 5]
    (agent,) = plan.role("agent_serve")
    assert agent.env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"
    assert agent.env["JAX_PLATFORMS"] == "cpu" and agent.http_port == 8000
    assert "TPU_VISIBLE_CHIPS" not in agent.env


def test_a_planned_server_keeps_the_users_xla_flags_but_the_plans_device_count():
    from launch.distributed import merge_xla_flags

    user = "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8 --xla_cpu_x=1"
    planned = "--xla_force_host_platform_device_count=1"
    assert merge_xla_flags(user, planned) == (
        "--xla_dump_to=/tmp/d --xla_cpu_x=1 --xla_force_host_platform_device_count=1"
    )
    assert merge_xla_flags("", planned) == planned


def test_parse_roles():
    assert parse_roles("policy_train=4, agent_serve=2") == {"policy_train": 4, "agent_serve": 2}
    for bad in ("policy_train", "policy_train=x", "Policy=2", "a=1,a=2"):
        with pytest.raises(PlanError):
            parse_roles(bad)


def test_cli_json_and_env(capsys):
    argv = [
        "plan-chips",
        "--accelerator",
        "v6e-8",
        "--roles",
        "policy_train=4,agent_serve=2,sim_serve=2",
    ]
    assert main(argv) == 0
    procs = json.loads(capsys.readouterr().out)
    assert [p["role"] for p in procs] == ["policy_train", "agent_serve", "sim_serve"]
    assert procs[0]["env"]["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,4,1"
    assert {"role", "kind", "chips", "env", "http_port", "host"} <= set(procs[0])
    assert main([*argv, "--format", "env"]) == 0
    out = capsys.readouterr().out
    assert "export TPU_VISIBLE_CHIPS=4,5" in out and "# sim_serve [serve]" in out
    assert "SIMLOOP_COORDINATOR" not in out  # one host: every role is a one-process job
    # Multi-host: each trainer process's id, host, coordinator and chips.
    multi = ["plan-chips", "--accelerator", "v6e-32", "--roles", "policy_train=16,sim_train=8",
             "--hostnames", ",".join(f"w{i}" for i in range(8))]  # fmt: skip
    assert main(multi) == 0
    procs = json.loads(capsys.readouterr().out)
    sim = [p for p in procs if p["role"] == "sim_train"]
    assert [(p["rank"], p["host"], p["hostname"], p["coordinator"], p["chips"]) for p in sim] == [
        (0, 4, "w4", "w4:8479", [0, 1, 2, 3]),
        (1, 5, "w5", "w4:8479", [0, 1, 2, 3]),
    ]
    assert sim[1]["env"]["SIMLOOP_PROCESS_ID"] == "1"
    assert main([*multi, "--format", "env"]) == 0
    out = capsys.readouterr().out
    assert "rank 1: chips 0,1,2,3, process 1 of 2, coordinator w4:8479" in out
    assert "export SIMLOOP_COORDINATOR=w4:8479" in out
    assert main(["plan-chips", "--accelerator", "v6e-8", "--roles", "policy_train=3"]) == 2
    assert "not a legal sub-slice" in capsys.readouterr().err


CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads_and_plans(path):
    """Each config in configs/ validates and its chip plan is legal; a trainer role's chips
    equal its model role's mesh size (the trainer builds that mesh over exactly them)."""
    cfg = load_config(SimloopConfig, path)
    plan = config_plan(cfg)
    for train_role, model_role in (("policy_train", "agent"), ("sim_train", "simulator")):
        if train_role in cfg.chips.roles:
            mesh = getattr(cfg, model_role).mesh
            assert mesh.size == cfg.chips.roles[train_role], (train_role, mesh)
            assert len(plan.device_ids(train_role)) == mesh.size
    assert {p.role for p in plan.processes} == set(cfg.chips.roles)


def test_the_tpu_configs_are_the_documented_splits():
    v6e8 = load_config(SimloopConfig, CONFIGS[0].parent / "v6e-8.yaml")
    assert v6e8.chips.roles == {"policy_train": 4, "agent_serve": 1, "sim_serve": 1}
    assert v6e8.chips.replicas == {"agent_serve": 2, "sim_serve": 2}
    plan = config_plan(v6e8)
    serve = [(p.role, p.replica, p.chips) for p in plan.processes if p.kind == "serve"]
    assert len(serve) == 4 and all(len(chips) == 1 for *_, chips in serve)
    # The jobs start the servers themselves (vllm-tpu), on the planned ports.
    assert v6e8.agent.server_url is None and v6e8.simulator.server_url is None
    assert v6e8.serve.backend == "vllm"
    assert v6e8.agent.model.num_layers == 28  # Qwen3-1.7B
    v6e32 = load_config(SimloopConfig, CONFIGS[0].parent / "v6e-32.yaml")
    assert plan_chips(v6e32.chips.accelerator, v6e32.chips.roles).accelerator.hosts == 8
