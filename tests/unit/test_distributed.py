"""The multi-process contract (`launch/distributed.py`): what a process reads from its
environment, what the local launcher gives each process, how it reports a failed process, and
the CLI's dry run and refusals. The processes themselves train in
tests/integration/test_multihost.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from launch import distributed
from launch.cli import main
from launch.distributed import ProcessEnv, from_environ, local_environments


def test_the_environment_names_the_process_or_says_what_is_wrong():
    assert from_environ({}) is None
    env = {
        "SIMLOOP_COORDINATOR": "10.0.0.2:1234",
        "SIMLOOP_NUM_PROCESSES": "4",
        "SIMLOOP_PROCESS_ID": "3",
    }
    assert from_environ(env) == ProcessEnv("10.0.0.2:1234", 4, 3)
    assert from_environ({**env, "SIMLOOP_NUM_PROCESSES": "1", "SIMLOOP_PROCESS_ID": "0"}) is None
    bad = [
        ({"SIMLOOP_PROCESS_ID": "1"}, "SIMLOOP_NUM_PROCESSES is not"),
        ({**env, "SIMLOOP_PROCESS_ID": "4"}, "0 <= ID < N"),
        ({**env, "SIMLOOP_PROCESS_ID": "x"}, "must be integers"),
        ({**env, "SIMLOOP_COORDINATOR": "nohost"}, "HOST:PORT"),
    ]
    for environ, why in bad:
        with pytest.raises(ValueError, match=why):
            from_environ(environ)


def test_each_local_process_gets_the_contract_and_its_share_of_devices():
    flags = "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8"
    envs = local_environments(2, 4, {"XLA_FLAGS": flags, "HOME": "/h"})
    assert [e["SIMLOOP_PROCESS_ID"] for e in envs] == ["0", "1"]
    assert {e["SIMLOOP_NUM_PROCESSES"] for e in envs} == {"2"}
    assert len({e["SIMLOOP_COORDINATOR"] for e in envs}) == 1
    for e in envs:  # the user's flags kept, the device count replaced
        assert e["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=4"
        assert e["HOME"] == "/h" and e["JAX_PLATFORMS"] == "cpu"


def _procs(*codes_after: tuple[int, float]) -> list[subprocess.Popen]:
    return [
        subprocess.Popen([sys.executable, "-c", f"import time,sys; time.sleep({t}); sys.exit({c})"])
        for c, t in codes_after
    ]


def test_the_launcher_reports_the_first_failure_and_stops_a_lingering_process(tmp_path, capsys):
    t = time.monotonic()
    code = distributed._wait(_procs((0, 60), (3, 0.2)), tmp_path, grace_s=1.0)
    assert code == 3 and time.monotonic() - t < 20
    err = capsys.readouterr().err
    assert "process 1 of 2 exited 3 first" in err and f"{tmp_path}/process-1.log" in err
    assert "0 was killed by SIGKILL" in err and "Run the same command again" in err
    assert distributed._wait(_procs((0, 0), (0, 0.1)), tmp_path, grace_s=1.0) == 0


def test_dry_run_shows_each_process_and_jobs_that_stay_single_refuse(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # the CLI sets it
    common = ["--config", "configs/demo_cpu.yaml", "--out", str(tmp_path)]
    # The processes split the trainer role's chips (its servers are processes of their own).
    assert main(["train-sim", *common, "--run.processes", "2", "--dry-run", "--format", "json",
                 "--chips.roles", "{sim_train: 8}"]) == 0  # fmt: skip
    rows = json.loads(capsys.readouterr().out)["processes"]
    assert [r["process_id"] for r in rows] == [0, 1]
    assert [r["devices"] for r in rows] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rows[1]["env"]["SIMLOOP_PROCESS_ID"] == "1" and rows[0]["coordinator"]
    assert "--dry-run" not in rows[0]["command"]
    assert main(["train-sim", *common, "--run.processes", "3", "--dry-run"]) == 2
    assert "split the chips of chips.roles.sim_train" in capsys.readouterr().err
    assert main(["demo", *common, "--run.processes", "2"]) == 2
    err = capsys.readouterr().err
    assert "only pretrain-sim, train-sim, train-agent run as several JAX processes" in err
    assert "one-machine CPU experiment" in err


def test_rehearse_rebases_the_pod_paths_and_refuses_a_cpu_plan(tmp_path, capsys):
    from launch.jobs.rehearse import _rebase

    root = tmp_path / "fs"
    text = "--out /ckpt/runs/x --config /config/config.yaml /ckptx /mnt/ckpt a/ckpt/b"
    got = _rebase(text, ["/config", "/ckpt", "/mnt"], root)
    assert got == (
        f"--out {root}/ckpt/runs/x --config {root}/config/config.yaml /ckptx "
        f"{root}/mnt/ckpt a/ckpt/b"
    )
    assert main(["rehearse", "--config", "configs/demo_cpu.yaml", "--out", str(tmp_path)]) == 2
    assert "rehearse takes a TPU config" in capsys.readouterr().err


def test_rehearse_dry_run_lists_every_pod_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["rehearse", "--config", "configs/gke-v6e-32.yaml", "--out", str(out),
                 "--dry-run", "--format", "json"]) == 0  # fmt: skip
    pods = json.loads(capsys.readouterr().out)["pods"]
    assert [p["host"] for p in pods] == list(range(8)) and not out.exists()
    procs = [(p["host"], q) for p in pods for q in p["processes"]]
    policy = [(h, q) for h, q in procs if q["role"] == "policy_train"]
    assert [(h, q["rank"]) for h, q in policy] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert len({q["coordinator"] for _, q in policy}) == 1
    assert all(q["env"]["XLA_FLAGS"].endswith(f"={len(q['chips'])}") for _, q in procs)
    servers = [q for _, q in procs if q["kind"] == "serve"]
    assert servers and all("serving.vllm.fake_server" in q["command"] for q in servers)
