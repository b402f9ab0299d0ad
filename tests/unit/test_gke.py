"""`simloop gke render` (JobSet manifests for v6e slices), its check against the Kubernetes object
models, and the in-pod launcher that runs each host's processes.

The rendered manifests of the shipped GKE configs are pinned in tests/golden/gke/<config>.yaml,
byte for byte. After an intended change to the manifests (or to the config schema, whose resolved
config the ConfigMap carries), regenerate them and review the diff:

    SIMLOOP_UPDATE_GOLDEN=1 .venv/bin/pytest tests/unit/test_gke.py -k golden
    git diff tests/golden/gke
"""

import copy
import difflib
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launch.cli import main
from launch.config.loading import load_config
from launch.config.schema import SimloopConfig
from launch.deploy import gke, gke_pod
from launch.deploy.chips import config_plan, parse_accelerator
from launch.deploy.k8s_schema import ManifestError, check, validate

REPO = Path(__file__).resolve().parents[2]
V6E_8 = REPO / "configs" / "gke-v6e-8.yaml"
V6E_32 = REPO / "configs" / "gke-v6e-32.yaml"
GOLDEN = REPO / "tests" / "golden" / "gke"
UPDATE_GOLDEN = os.environ.get("SIMLOOP_UPDATE_GOLDEN") == "1"
TPU_KEYS = (
    "TPU_VISIBLE_CHIPS",
    "TPU_CHIPS_PER_PROCESS_BOUNDS",
    "TPU_PROCESS_BOUNDS",
    "TPU_PROCESS_PORT",
    "TPU_PROCESS_ADDRESSES",
    "CLOUD_TPU_TASK_ID",
)


def _render(path):
    cfg = load_config(SimloopConfig, path)
    return cfg, {d["kind"]: d for d in gke.render(cfg)}


def _pod(jobset):
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    return job, job["template"]


def _planner(cfg):
    acc = parse_accelerator(cfg.chips.accelerator)
    names = (
        None if acc.hosts == 1 else [gke.pod_hostname(cfg.gke.name, i) for i in range(acc.hosts)]
    )
    return config_plan(cfg, hostnames=names)


@pytest.mark.parametrize("path", [V6E_8, V6E_32], ids=lambda p: p.name)
def test_example_configs_load_and_plan(path):
    cfg = load_config(SimloopConfig, path)
    plan = _planner(cfg)
    asked = sum(n * cfg.chips.replicas.get(r, 1) for r, n in cfg.chips.roles.items())
    assert sum(len(p.chips) for p in plan.processes) == asked
    assert cfg.gke.bucket or cfg.gke.pvc


@pytest.mark.parametrize("path", [V6E_8, V6E_32], ids=lambda p: p.name)
def test_rendered_manifests_validate(path):
    _, docs = _render(path)
    assert list(docs) == ["Service", "ConfigMap", "JobSet"]
    for doc in docs.values():
        assert validate(doc) == []


def _same_as_golden(text: str, golden: Path) -> None:
    if UPDATE_GOLDEN:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_bytes(text.encode())
    want = golden.read_bytes().decode()
    diff = difflib.unified_diff(want.splitlines(True), text.splitlines(True), golden.name, "render")
    assert text == want, f"render != {golden}; SIMLOOP_UPDATE_GOLDEN=1 rewrites it:\n" + "".join(
        list(diff)[:60]
    )


@pytest.mark.parametrize("path", [V6E_8, V6E_32], ids=lambda p: p.name)
def test_render_matches_the_golden_manifests(path, capsys):
    """`simloop gke render --config configs/<config>` prints tests/golden/gke/<config> exactly
    (SIMLOOP_UPDATE_GOLDEN=1 rewrites the file instead; see the module docstring)."""
    assert main(["gke", "render", "--config", str(path)]) == 0
    _same_as_golden(capsys.readouterr().out, GOLDEN / path.name)


def test_golden_render_is_deterministic_across_processes():
    """A fresh process with another hash seed (set order) and working directory prints the
    same bytes: no timestamps, paths or dict-order dependence in the manifests."""
    env = {**os.environ, "PYTHONHASHSEED": "4242", "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "launch", "gke", "render", "--config", str(V6E_32)]
    r = subprocess.run(args, cwd=GOLDEN, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (GOLDEN / V6E_32.name).read_text()


def test_help_and_config_checks_do_not_import_kubernetes():
    code = (
        "import contextlib, io, sys; from launch.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        f"assert main(['config', '--config', {str(V6E_8)!r}]) == 0\n"
        "assert 'kubernetes' not in sys.modules, 'kubernetes imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_v6e_8_single_host_with_pvc():
    cfg, docs = _render(V6E_8)
    svc, jobset = docs["Service"], docs["JobSet"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {"jobset.sigs.k8s.io/jobset-name": "simloop-v6e-8"}
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    assert jobset["spec"]["network"]["subdomain"] == svc["metadata"]["name"]
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == cfg.gke.max_restarts
    job, pod = _pod(jobset)
    assert job["parallelism"] == job["completions"] == 1
    assert job["completionMode"] == "Indexed"
    assert job["backoffLimit"] == cfg.gke.backoff_limit
    assert "successPolicy" not in job  # the only host trains
    spec = pod["spec"]
    assert spec["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
        "cloud.google.com/gke-tpu-topology": "2x4",
    }
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["restartPolicy"] == "Never"
    assert spec["serviceAccountName"] == "simloop"
    (container,) = spec["containers"]
    assert container["resources"] == {
        "requests": {"google.com/tpu": 8},
        "limits": {"google.com/tpu": 8},
    }
    assert container["command"][:6] == [
        "python",
        "-m",
        "launch.deploy.gke_pod",
        "--plan",
        gke.PLAN_PATH,
        "--",
    ]
    assert container["command"][6:] == cfg.gke.command
    assert {"checkpoints", "config"} == {v["name"] for v in spec["volumes"]}
    ckpt = next(v for v in spec["volumes"] if v["name"] == "checkpoints")
    assert ckpt == {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "simloop-ckpt"}}
    assert {"name": "checkpoints", "mountPath": "/ckpt"} in container["volumeMounts"]
    assert "annotations" not in pod["metadata"]  # no gcsfuse sidecar without a bucket
    assert "annotations" not in jobset["metadata"]  # exclusive placement: multi-host only
    assert [p["containerPort"] for p in container["ports"]] == [8000, 8001, 8002, 8003]


def test_v6e_32_multi_host_with_bucket():
    cfg, docs = _render(V6E_32)
    jobset = docs["JobSet"]
    job, pod = _pod(jobset)
    spec = pod["spec"]
    assert job["parallelism"] == job["completions"] == 8
    assert spec["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x8"
    assert spec["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice"
    tpu = spec["containers"][0]["resources"]
    assert tpu["requests"]["google.com/tpu"] == tpu["limits"]["google.com/tpu"] == 4
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    ckpt = next(v for v in spec["volumes"] if v["name"] == "checkpoints")
    assert ckpt["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
    assert ckpt["csi"]["volumeAttributes"]["bucketName"] == "my-project-simloop"
    assert pod["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}
    assert jobset["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
    }
    # Hosts 6 and 7 only serve: the Job succeeds once the training hosts 0-5 have.
    assert job["successPolicy"] == {"rules": [{"succeededIndexes": "0-5"}]}


@pytest.mark.parametrize("path", [V6E_8, V6E_32], ids=lambda p: p.name)
def test_plan_json_gives_every_host_the_planners_environment(path):
    cfg, docs = _render(path)
    layout = json.loads(docs["ConfigMap"]["data"]["plan.json"])
    planner = _planner(cfg)
    acc = planner.accelerator
    assert len(layout["hosts"]) == acc.hosts
    for host in layout["hosts"]:
        expected = [p for p in planner.processes if p.host == host["index"]]
        assert [p["role"] for p in host["processes"]] == [p.role for p in expected]
        for got, want in zip(host["processes"], expected, strict=True):
            for key in TPU_KEYS:
                assert got["env"][key] == want.env[key], (host["index"], want.role, key)
            assert got["env"]["SIMLOOP_ROLE"] == want.role
            # GKE's slice-wide worker variables narrowed to the process's own group.
            assert got["env"]["TPU_WORKER_ID"] == str(want.rank)
            assert got["env"]["TPU_HOST_BOUNDS"] == want.env["TPU_PROCESS_BOUNDS"]
            peers = want.env["TPU_PROCESS_ADDRESSES"].split(",")
            assert got["env"]["TPU_WORKER_HOSTNAMES"].split(",") == [
                a.rsplit(":", 1)[0] for a in peers
            ]
            if want.http_port:
                assert got["env"]["SIMLOOP_HTTP_PORT"] == str(want.http_port)
            if want.coordinator is not None:
                # The JAX job's contract and the TPU runtime's narrowed view name one group.
                workers = got["env"]["TPU_WORKER_HOSTNAMES"].split(",")
                assert got["env"]["SIMLOOP_COORDINATOR"].rsplit(":", 1)[0] == workers[0]
                assert got["env"]["SIMLOOP_PROCESS_ID"] == got["env"]["TPU_WORKER_ID"]
                assert got["env"]["SIMLOOP_NUM_PROCESSES"] == str(len(workers))
                assert got["coordinator"] == got["env"]["SIMLOOP_COORDINATOR"]


def test_multi_host_addresses_are_the_jobset_pod_names():
    cfg, docs = _render(V6E_32)
    layout = json.loads(docs["ConfigMap"]["data"]["plan.json"])
    policy = [p for h in layout["hosts"] for p in h["processes"] if p["role"] == "policy_train"]
    assert len(policy) == 4
    assert policy[0]["env"]["TPU_PROCESS_ADDRESSES"] == ",".join(
        f"simloop-v6e-32-slice-0-{i}.simloop-v6e-32:8476" for i in range(4)
    )
    # The trainers find the servers at the hosts and ports the plan gives them.
    serve = {
        p["role"]: (h["hostname"], p["http_port"])
        for h in layout["hosts"]
        for p in h["processes"]
        if p["kind"] == "serve"
    }
    urls = json.loads(policy[0]["env"]["SIMLOOP_SERVER_URLS"])
    assert urls["agent"] == ["http://{}:{}".format(*serve["agent_serve"])]
    assert urls["simulator"] == ["http://{}:{}".format(*serve["sim_serve"])]
    # ... bound to all interfaces: the trainers run on other hosts.
    servers = [p for h in layout["hosts"] for p in h["processes"] if p["kind"] == "serve"]
    assert all(p["command"][p["command"].index("--host") + 1] == "0.0.0.0" for p in servers)


def _contract(env):
    keys = ("SIMLOOP_COORDINATOR", "SIMLOOP_NUM_PROCESSES", "SIMLOOP_PROCESS_ID")
    return {k: env[k] for k in keys if k in env}


def test_each_pod_of_a_multi_host_trainer_gets_the_process_contract():
    """policy_train on pods 0-3 and sim_train on pods 4-5 are JAX jobs of 4 and 2 processes:
    ids 0..N-1 in pod order, one coordinator (the group's first pod, a port of its own);
    the servers of pods 6-7 get no contract."""
    cfg, docs = _render(V6E_32)
    layout = json.loads(docs["ConfigMap"]["data"]["plan.json"])
    by_role = {}
    for host in layout["hosts"]:
        for p in host["processes"]:
            by_role.setdefault(p["role"], []).append((host["index"], _contract(p["env"])))
    ports = set()
    for role, pods in (("policy_train", [0, 1, 2, 3]), ("sim_train", [4, 5])):
        got = by_role[role]
        assert [h for h, _ in got] == pods
        assert [c["SIMLOOP_PROCESS_ID"] for _, c in got] == [str(i) for i in range(len(pods))]
        assert {c["SIMLOOP_NUM_PROCESSES"] for _, c in got} == {str(len(pods))}
        (coordinator,) = {c["SIMLOOP_COORDINATOR"] for _, c in got}
        host, port = coordinator.rsplit(":", 1)
        assert host == gke.pod_hostname(cfg.gke.name, pods[0])
        ports.add(int(port))
    assert len(ports) == 2
    served = {p["http_port"] for h in layout["hosts"] for p in h["processes"] if p["http_port"]}
    tpu = {int(p["env"]["TPU_PROCESS_PORT"]) for h in layout["hosts"] for p in h["processes"]}
    assert not ports & (served | tpu)
    for role in ("agent_serve", "sim_serve"):
        assert [c for _, c in by_role[role]] == [{}]
    # One host: every process is a one-process job.
    _, single = _render(V6E_8)
    (host,) = json.loads(single["ConfigMap"]["data"]["plan.json"])["hosts"]
    assert all(_contract(p["env"]) == {} and p["coordinator"] is None for p in host["processes"])


# Prints this process's contract into $OUT/<id>.json (a pod's trainer, run by the pod entry).
_REPORT = (
    "import json, os; e = os.environ; "
    "open(os.path.join(e['OUT'], e['SIMLOOP_PROCESS_ID'] + '.json'), 'w').write(json.dumps("
    "{k: e[k] for k in ('SIMLOOP_COORDINATOR', 'SIMLOOP_NUM_PROCESSES', 'SIMLOOP_PROCESS_ID', "
    "'SIMLOOP_ROLE', 'TPU_WORKER_ID')}))"
)


def test_two_pods_of_one_trainer_group_start_one_job(tmp_path):
    """The pod entry, run as two pods (4 and 5: sim_train of gke-v6e-32) at once, starts each
    pod's trainer with the same coordinator and process ids 0 and 1."""
    cfg, docs = _render(V6E_32)
    plan = tmp_path / "plan.json"
    plan.write_text(docs["ConfigMap"]["data"]["plan.json"])
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(REPO)}
    entry = [sys.executable, "-m", "launch.deploy.gke_pod", "--plan", str(plan)]
    command = ["--", sys.executable, "-c", _REPORT]
    run = {"env": env, "stderr": subprocess.PIPE, "text": True}
    pods = [subprocess.Popen([*entry, "--host-index", str(i), *command], **run) for i in (4, 5)]
    logs = [p.communicate(timeout=120)[1] for p in pods]
    assert [p.returncode for p in pods] == [0, 0], logs
    seen = [json.loads((out / f"{i}.json").read_text()) for i in range(2)]
    coordinator = f"{gke.pod_hostname(cfg.gke.name, 4)}:8481"
    assert seen == [
        {
            "SIMLOOP_COORDINATOR": coordinator,
            "SIMLOOP_NUM_PROCESSES": "2",
            "SIMLOOP_PROCESS_ID": str(i),
            "SIMLOOP_ROLE": "sim_train",
            "TPU_WORKER_ID": str(i),
        }
        for i in range(2)
    ]
    assert f"process 1 of 2, coordinator {coordinator}" in logs[1]


def test_single_host_processes_address_localhost():
    cfg, docs = _render(V6E_8)
    (host,) = json.loads(docs["ConfigMap"]["data"]["plan.json"])["hosts"]
    for proc in host["processes"]:
        assert proc["env"]["TPU_PROCESS_ADDRESSES"].startswith("localhost:")
    agents = [p for p in host["processes"] if p["role"] == "agent_serve"]
    trainer = next(p for p in host["processes"] if p["role"] == "policy_train")
    urls = json.loads(trainer["env"]["SIMLOOP_SERVER_URLS"])
    assert urls["agent"] == [f"http://127.0.0.1:{p['http_port']}" for p in agents]
    assert cfg.agent.server_url is None


def test_yaml_output_round_trips_and_carries_the_config(tmp_path):
    cfg, docs = _render(V6E_32)
    text = gke.to_yaml(list(docs.values()))
    assert text.count("\n---\n") == 2
    assert list(yaml.safe_load_all(text)) == list(docs.values())
    resolved = tmp_path / "config.yaml"
    resolved.write_text(docs["ConfigMap"]["data"]["config.yaml"])
    assert load_config(SimloopConfig, resolved) == cfg


@functools.cache
def _v6e_32_docs():
    return _render(V6E_32)[1]  # deep-copy before editing


JOB = "JobSet.spec.replicatedJobs[0]"
POD = f"{JOB}.template.spec.template"
CONTAINER = f"{POD}.spec.containers[0]"


def _container(d):
    return _pod(d)[1]["spec"]["containers"][0]


@pytest.mark.parametrize(
    "kind, edit, error",
    [
        (
            "JobSet",
            lambda d: _pod(d)[1]["spec"].update(hostNetwrok=_pod(d)[1]["spec"].pop("hostNetwork")),
            f"{POD}.spec: unknown field 'hostNetwrok' of V1PodSpec (did you mean 'hostNetwork'?)",
        ),
        (
            "JobSet",
            lambda d: d["spec"]["replicatedJobs"][0].update(replicas="2"),
            f"{JOB}.replicas: expected int, got str '2'",
        ),
        (
            "JobSet",
            lambda d: _pod(d)[0].update(parallelism="8"),
            f"{JOB}.template.spec.parallelism: expected int, got str '8'",
        ),
        (
            "JobSet",
            lambda d: _container(d)["ports"][0].update(containerPort="8000"),
            f"{CONTAINER}.ports[0].containerPort: expected int, got str '8000'",
        ),
        (
            "JobSet",
            lambda d: _container(d)["env"][0].update(value=1),
            f"{CONTAINER}.env[0].value: expected str, got int 1",
        ),
        (
            "JobSet",
            lambda d: _container(d)["resources"].update(limits=[8]),
            f"{CONTAINER}.resources.limits: expected dict(str, quantity), got list",
        ),
        (
            "JobSet",
            lambda d: _container(d)["resources"]["limits"].update({"google.com/tpu": True}),
            f"{CONTAINER}.resources.limits['google.com/tpu']: expected str or number, got bool",
        ),
        (
            "JobSet",
            lambda d: _container(d).pop("name"),
            f"{CONTAINER}: missing required field 'name' of V1Container",
        ),
        (
            "JobSet",
            lambda d: _pod(d)[1]["spec"]["volumes"][1]["csi"].pop("driver"),
            f"{POD}.spec.volumes[1].csi: missing required field 'driver' of V1CSIVolumeSource",
        ),
        (
            "JobSet",
            lambda d: _pod(d)[1]["metadata"].update(annotations={"gke-gcsfuse/volumes": True}),
            f"{POD}.metadata.annotations['gke-gcsfuse/volumes']: expected str, got bool True",
        ),
        (
            "JobSet",
            lambda d: d["spec"]["network"].update(enableDNSHostnames="true"),
            "JobSet.spec.network.enableDNSHostnames: expected bool, got str 'true'",
        ),
        (
            "JobSet",
            lambda d: d["spec"]["failurePolicy"].update(restartStrategy="Restart"),
            "JobSet.spec.failurePolicy.restartStrategy: 'Restart' is not one of",
        ),
        (
            "JobSet",
            lambda d: d["spec"]["replicatedJobs"][0].pop("template"),
            f"{JOB}: missing required field 'template' of ReplicatedJob",
        ),
        (
            "JobSet",
            lambda d: d["spec"].update(succesPolicy={"operator": "All"}),
            "JobSet.spec: unknown field 'succesPolicy' of JobSetSpec (did you mean 'successPolicy'",
        ),
        (
            "JobSet",
            lambda d: d["metadata"].update(labels=["simloop"]),
            "JobSet.metadata.labels: expected dict(str, str), got list",
        ),
        (
            "JobSet",
            lambda d: d.update(apiVersion="jobset.x-k8s.io/v1alpha1"),
            "<manifest>: apiVersion/kind 'jobset.x-k8s.io/v1alpha1'/'JobSet' is not one of",
        ),
        (
            "Service",
            lambda d: d["spec"].update(ports=[{"name": "http", "targetPort": 8000}]),
            "Service.spec.ports[0]: missing required field 'port' of V1ServicePort",
        ),
        (
            "Service",
            lambda d: d["spec"].update(clusterIp="None"),
            "Service.spec: unknown field 'clusterIp' of V1ServiceSpec (did you mean 'clusterIP'?)",
        ),
        (
            "ConfigMap",
            lambda d: d["data"].update({"plan.json": {"hosts": []}}),
            "ConfigMap.data['plan.json']: expected str, got mapping",
        ),
    ],
)
def test_validator_rejects(kind, edit, error):
    bad = copy.deepcopy(_v6e_32_docs()[kind])
    edit(bad)
    errors = validate(bad)
    assert len(errors) == 1 and errors[0].startswith(error), errors
    with pytest.raises(ManifestError, match=f"^invalid {kind} ") as e:
        check(bad)
    assert error in str(e.value)


def test_validator_accepts_quantities_as_strings_and_int_or_string_ports():
    docs = _v6e_32_docs()
    jobset, service = copy.deepcopy(docs["JobSet"]), copy.deepcopy(docs["Service"])
    _container(jobset)["resources"] = {"limits": {"google.com/tpu": "4", "memory": "16Gi"}}
    service["spec"]["ports"] = [
        {"name": "agent", "port": 8000, "targetPort": "agent-serve"},
        {"name": "sim", "port": 8001, "targetPort": 8001},
    ]
    assert validate(jobset) == validate(service) == []


def _without_volume(tmp_path):
    tree = yaml.safe_load(V6E_8.read_text())
    del tree["gke"]["pvc"]
    path = tmp_path / "no-volume.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_cli_without_a_volume_fails_clearly(tmp_path, capsys):
    assert main(["gke", "render", "--config", str(_without_volume(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "gke.bucket" in err and "gke.pvc" in err


def test_cli_rejects_a_cpu_accelerator(capsys):
    assert main(["gke", "render", "--config", str(V6E_8), "--chips.accelerator", "cpu-8"]) == 2
    assert "needs a TPU slice" in capsys.readouterr().err


def test_cli_writes_the_manifests(tmp_path, capsys):
    out = tmp_path / "jobset.yaml"
    assert main(["gke", "render", "--config", str(V6E_32), "--output", str(out)]) == 0
    kinds = [d["kind"] for d in yaml.safe_load_all(out.read_text())]
    assert kinds == ["Service", "ConfigMap", "JobSet"]
    assert main(["gke", "render", "--config", str(V6E_8)]) == 0
    assert "kind: JobSet" in capsys.readouterr().out


# --- the in-pod launcher --------------------------------------------------------------------

# Each process records its environment; servers then wait to be stopped, trainers wait until
# every server has recorded its own and exit with $TRAIN_RC.
_CHILD = r"""
import json, os, sys, time
out = sys.argv[1]
role = os.environ["SIMLOOP_ROLE"] + "-" + os.environ["SIMLOOP_REPLICA"]
keys = ("SIMLOOP_ROLE", "SIMLOOP_PROCESS_KIND", "TPU_VISIBLE_CHIPS", "TPU_WORKER_ID", "JOB_MARK")
with open(os.path.join(out, role + ".json"), "w") as f:
    json.dump({k: os.environ.get(k) for k in keys}, f)
if os.environ["SIMLOOP_PROCESS_KIND"] == "serve":
    time.sleep(60)
deadline = time.time() + 20
while time.time() < deadline and len(os.listdir(out)) < int(os.environ["N_PROCS"]):
    time.sleep(0.05)
sys.exit(int(os.environ.get("TRAIN_RC", "0")))
"""


def _layout(tmp_path):
    """The v6e-8 pod's plan, each process running the test's command (servers' own
    `vllm serve` commands dropped: without one a process runs the pod's command)."""
    cfg = load_config(SimloopConfig, V6E_8)
    layout = gke.host_layout(cfg, gke.chip_plan(cfg))
    layout["stagger_s"] = 0.0
    for proc in layout["hosts"][0]["processes"]:
        proc.pop("command", None)
    out = tmp_path / "out"
    out.mkdir()
    return layout, out, [sys.executable, "-c", _CHILD, str(out)]


def test_launcher_runs_every_process_of_its_host_with_its_env(tmp_path, monkeypatch):
    layout, out, command = _layout(tmp_path)
    monkeypatch.setenv("N_PROCS", "5")
    monkeypatch.setenv("JOB_MARK", "from-the-pod")
    lock = tmp_path / "libtpu_lockfile"
    lock.write_text("")
    rc = gke_pod.launch(layout, 0, command, lockfile=str(lock), grace_s=5, poll_s=0.05)
    assert rc == 0  # the trainer succeeded; the servers were stopped
    assert not lock.exists()
    seen = {p.stem: json.loads(p.read_text()) for p in out.iterdir()}
    assert set(seen) == {
        "policy_train-0",
        "agent_serve-0",
        "agent_serve-1",
        "sim_serve-0",
        "sim_serve-1",
    }
    for proc in layout["hosts"][0]["processes"]:
        got = seen[f"{proc['role']}-{proc['replica']}"]
        assert got["TPU_VISIBLE_CHIPS"] == proc["env"]["TPU_VISIBLE_CHIPS"]
        assert got["SIMLOOP_PROCESS_KIND"] == proc["kind"]
        assert got["JOB_MARK"] == "from-the-pod"  # the pod's env passes through


def test_launcher_fails_when_a_process_fails(tmp_path, monkeypatch):
    layout, _, command = _layout(tmp_path)
    monkeypatch.setenv("N_PROCS", "5")
    monkeypatch.setenv("TRAIN_RC", "3")
    rc = gke_pod.launch(layout, 0, command, lockfile=str(tmp_path / "lock"), grace_s=5, poll_s=0.05)
    assert rc == 3


def test_launcher_host_without_processes_and_bad_index():
    layout = {"tpu": True, "stagger_s": 0, "hosts": [{"index": 0, "processes": []}]}
    assert gke_pod.launch(layout, 0, ["false"]) == 0
    assert gke_pod.launch(layout, 1, ["false"]) == 2


def test_launcher_main_reads_the_host_from_job_completion_index(tmp_path, monkeypatch, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"tpu": False, "hosts": [{"index": 0, "processes": []}] * 2}))
    monkeypatch.delenv("JOB_COMPLETION_INDEX", raising=False)
    assert gke_pod.main(["--plan", str(plan), "--", "true"]) == 2
    assert "JOB_COMPLETION_INDEX" in capsys.readouterr().err
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    assert gke_pod.main(["--plan", str(plan), "--", "true"]) == 0
    assert "nothing is planned on host 1" in capsys.readouterr().err
    assert gke_pod.main(["--plan", str(plan)]) == 2  # no command


def test_jax_servers_get_their_admin_token_from_a_secret():
    jax = load_config(SimloopConfig, V6E_8, ["--serve.backend", "jax"])
    with pytest.raises(gke.GkeError, match="gke.admin_token_secret") as e:
        gke.render(jax)
    assert "kubectl create secret generic" in str(e.value)
    secret = ["--serve.backend", "jax", "--gke.admin_token_secret", "simloop-admin"]
    cfg = load_config(SimloopConfig, V6E_8, secret)
    docs = {d["kind"]: d for d in gke.render(cfg)}  # validated against the k8s models too
    _, pod = _pod(docs["JobSet"])
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["SIMLOOP_ADMIN_TOKEN"] == {
        "name": "SIMLOOP_ADMIN_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "simloop-admin", "key": "token"}},
    }
    # vLLM servers (the TPU configs) take weights through their worker extension: no token
    _, vllm = _render(V6E_8)
    _, pod = _pod(vllm["JobSet"])
    assert "SIMLOOP_ADMIN_TOKEN" not in {e["name"] for e in pod["spec"]["containers"][0]["env"]}
